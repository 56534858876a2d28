"""Hugging Face in and out for Qwen3 (dense: q/k norms, a head size apart from hidden / heads) and the mixtures of
experts Mixtral and Qwen3-MoE, against `transformers` itself (PyTorch on CPU): tiny models built here with every
tensor random (nothing downloaded).

Logits within 1e-4 of transformers' (fp32, max abs over the logits' max abs) on 1 device; on (expert 4, data 2) the
loss through the expert-parallel step (all-to-all) equals transformers' cross-entropy; 2 training steps there, `--format
hf` export, `from_pretrained` gives jaxpar's logits; HF -> jaxpar -> HF is bitwise; unsupported kinds are refused."""
import json
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import run_config, steps_for  # noqa: E402
from hf_checks import close, hf_logits, hf_tensors, logits_of  # noqa: E402
from jaxpar import trainer  # noqa: E402
from jaxpar.formats import hf
from jaxpar.state import runs
from jaxpar.config import ConfigError  # noqa: E402
from jaxpar.data import ByteTokenizer  # noqa: E402
from jaxpar.export import main as export_main  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_hf_moe")
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")

V = 300
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
              max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=0,
              eos_token_id=0)
KINDS = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, intermediate_size=48, head_dim=16)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=48, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True)),
}
TOKENS = np.random.default_rng(0).integers(0, V, (8, 17)).astype(np.int32)


def hf_model(kind):
    torch.manual_seed(0)
    model = KINDS[kind]()
    with torch.no_grad():  # norm scales away from 1, routers sharp enough that the choice matters
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in KINDS:
        model, d = hf_model(kind), tmp_path_factory.mktemp(kind)
        model.save_pretrained(d)
        ByteTokenizer.to_hf().save(str(d / "tokenizer.json"))
        out[kind] = (model, d)
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_gives_transformers_logits_on_one_device(models, kind):
    model, d = models[kind]
    fwd, params, _ = hf.load(str(d))
    cfg = fwd.cfg
    assert (cfg.experts, cfg.qk_norm, cfg.head_dim) == {"qwen3": (0, True, 16), "mixtral": (8, False, 8),
                                                        "qwen3_moe": (8, True, 16)}[kind]
    close(logits_of(fwd, params, TOKENS, V), hf_logits(model, TOKENS))


def ce(logits, tokens):
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(torch.tensor(logits).reshape(-1, V),
                                                       torch.tensor(tokens, dtype=torch.long).reshape(-1)))


@needs8
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_expert_parallel_loss_equals_transformers(models, corpus, tmp_path, kind):
    """Imported onto (expert 4, data 2): the loss of the train step's expert-parallel forward (tokens to their
    experts' devices by all-to-all) and of evaluation equal transformers' cross-entropy."""
    model, d = models[kind]
    config = hf.apply(run_config(corpus, tmp_path, **{"mesh.expert": 4, "mesh.data": 2, "init_from": f"hf:{d}"}))
    steps = steps_for(config, V)
    params = hf.load_params(str(d), steps.cfg, steps.state_shardings["params"], steps.layer_order)
    tokens = {"tokens": jax.device_put(TOKENS, steps.batch_sharding)}
    want = ce(hf_logits(model, TOKENS[:, :-1]), TOKENS[:, 1:])
    loss, _ = steps.grads(params, tokens)
    lsum, n = steps.evaluate(params, tokens)
    np.testing.assert_allclose([float(loss), float(lsum) / float(n)], [want, want], rtol=1e-5)


@needs8
def test_export_after_training_on_expert_parallel_layout_loads_in_transformers(models, corpus, tmp_path):
    """Qwen3-MoE: 2 steps at (expert 4, data 2) from the HF weights, `--format hf` export, `from_pretrained` gives
    jaxpar's logits of the trained params."""
    model, d = models["qwen3_moe"]
    over = {"mesh.expert": 4, "mesh.data": 2, "init_from": f"hf:{d}", "train.steps": 2,
            "checkpoint.every_steps": 2}
    wd = tmp_path / "run"
    trainer.run(run_config(corpus, tmp_path, **over), str(wd))
    assert export_main(["--workdir", str(wd), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    run = runs.load_run(str(wd))
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(trained).__name__ == "Qwen3MoeForCausalLM"
    close(hf_logits(trained, TOKENS), logits_of(run.fwd, run.params, TOKENS, V))
    assert np.abs(hf_logits(trained, TOKENS) - hf_logits(model, TOKENS)).max() > 1e-3  # it did train


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_is_bitwise(models, tmp_path, kind):
    model, d = models[kind]
    fwd, params, tok = hf.load(str(d))
    out = tmp_path / "out"
    out.mkdir()
    hf.save(jax.device_get(params), fwd.cfg, tok, str(out), "float32", 10 ** 9)
    src, dst = hf_tensors(d), hf_tensors(out)
    assert src.keys() == dst.keys()
    for k in src:
        assert src[k].dtype == dst[k].dtype and src[k].tobytes() == dst[k].tobytes(), k
    with open(out / "config.json") as f:
        assert json.load(f)["architectures"] == [type(model).__name__]
    close(hf_logits(type(model).from_pretrained(str(out)).eval(), TOKENS), hf_logits(model, TOKENS))


def edit(src, dst, **changes):
    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        c = json.load(f)
    c.update(changes)
    with open(dst / "config.json", "w") as f:
        json.dump(c, f)
    return dst


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["DeepseekV3ForCausalLM"]}, r"DeepseekV3ForCausalLM needs DeepSeek's multi-head latent"),
    ({"architectures": ["GptOssForCausalLM"]}, r"GptOssForCausalLM needs gpt-oss's attention sinks"),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, r"Qwen2MoeForCausalLM needs Qwen2-MoE's gated shared expert"),
    ({"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\].*dense layers among the MoE ones"),
    ({"num_experts_per_tok": 9}, r"model.experts_per_token=9 > model.experts=8"),
])
def test_unsupported_moe_directory_is_refused(models, tmp_path, change, match):
    _, d = models["qwen3_moe"]
    with pytest.raises(ConfigError, match=match):
        hf.load(str(edit(d, tmp_path / "bad", **change)))
