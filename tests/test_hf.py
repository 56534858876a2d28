"""Hugging Face in and out, against `transformers` itself (PyTorch on CPU): tiny GPT-2 and Llama models built here
from a config (nothing downloaded) with every tensor, biases and norm scales included, filled with random values.

HF -> jaxpar logits within 1e-4 of transformers' (fp32, max abs over the logits' max abs) on 1 device and placed on
(2,2,2), where the pipelined loss equals transformers' loss; jaxpar -> HF after training steps at (2,1,4) loads with
`from_pretrained` and gives jaxpar's logits; HF -> jaxpar -> HF is bitwise (GPT-2's key bias excepted: zeros); a
sharded checkpoint imports as the unsharded one; Llama 3's RoPE scaling equals transformers'; bad directories are
refused before anything compiles or is written."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
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
from jaxpar.data import BPETokenizer, ByteTokenizer  # noqa: E402
from jaxpar.export import main as export_main  # noqa: E402
from jaxpar.parallel.logical import activation_rules  # noqa: E402
from jaxpar.model import ModelConfig, init_params  # noqa: E402
from jaxpar.model.layers import rope_frequencies  # noqa: E402

# one worker builds this module's shared fixtures once (under pytest-xdist `--dist loadgroup`)
pytestmark = pytest.mark.xdist_group("test_hf")

V = 300  # the HF vocabulary: jaxpar pads it to 384; the byte tokenizer uses 256 of it
ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}  # scaling takes effect within the 16-token windows used here


def hf_model(arch):
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=V, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                       max_position_embeddings=64, rope_theta=10000.0, rope_scaling=dict(ROPE),
                                       tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF's init zeroes biases and sets norm scales to 1, which would hide mistakes
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name or "ln" in name
                                                                              else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{arch: (transformers model, directory, sharded directory)}."""
    out = {}
    for arch in ("gpt2", "llama"):
        model, d = hf_model(arch), tmp_path_factory.mktemp(arch)
        model.save_pretrained(d / "single")
        model.save_pretrained(d / "sharded", max_shard_size="20KB")
        for sub in ("single", "sharded"):
            ByteTokenizer.to_hf().save(str(d / sub / "tokenizer.json"))
        assert len([n for n in os.listdir(d / "sharded") if n.endswith(".safetensors")]) > 2
        out[arch] = (model, d / "single", d / "sharded")
    return out


TOKENS = np.random.default_rng(0).integers(0, V, (4, 17)).astype(np.int32)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_import_gives_transformers_logits_on_one_device(models, arch):
    model, single, _ = models[arch]
    fwd, params, tok = hf.load(str(single))
    assert fwd.cfg.arch == arch and fwd.cfg.vocab_size == 384 and tok.vocab_size == 256
    close(logits_of(fwd, params, TOKENS, V), hf_logits(model, TOKENS))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_import_onto_2_2_2_gives_transformers_logits_and_loss(models, corpus, tmp_path, arch):
    model, single, _ = models[arch]
    config = run_config(corpus, tmp_path, **{"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2,
                                             "train.microbatches": 2, "init_from": f"hf:{single}"})
    before = config.to_json()
    config, given = hf.apply(config), config
    assert given.to_json() == before and config.model.arch == arch  # a new config; the caller's is left alone
    steps = steps_for(config, V)
    params = hf.load_params(str(single), steps.cfg, steps.state_shardings["params"], steps.layer_order)
    some = jax.tree.leaves(params)[0]
    assert dict(some.sharding.mesh.shape) == {"data": 2, "stage": 2, "expert": 1, "context": 1, "tensor": 2}
    fwd = steps.fwd
    with activation_rules(config.rules, steps.mesh):  # tensor-parallel compute on the placed (2,2,2) params
        got = jax.jit(lambda p, t: fwd.logits(p, fwd.layers(p["blocks"], fwd.embed(p, t))))(
            params, jnp.asarray(TOKENS[:, :-1]))
    want = hf_logits(model, TOKENS[:, :-1])
    close(np.asarray(got)[..., :V], want)
    # the pipelined loss (GPipe over 2 stages, 2 microbatches, TP 2) equals transformers' cross-entropy
    tokens = jax.device_put(TOKENS, steps.batch_sharding)
    lsum, n = steps.evaluate(params, {"tokens": tokens})
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(torch.tensor(want).reshape(-1, V),
                                                torch.tensor(TOKENS[:, 1:], dtype=torch.long).reshape(-1))
    np.testing.assert_allclose(float(lsum) / float(n), float(ref), rtol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sharded_checkpoint_imports_as_the_unsharded_one(models, arch):
    _, single, sharded = models[arch]
    a, b = hf.load(str(single))[1], hf.load(str(sharded))[1]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_round_trip_is_bitwise(models, tmp_path, arch):
    model, single, _ = models[arch]
    fwd, params, tok = hf.load(str(single))
    out = tmp_path / "out"
    out.mkdir()
    hf.save(jax.device_get(params), fwd.cfg, tok, str(out), "float32", 10 ** 9)
    src, dst = hf_tensors(single), hf_tensors(out)
    assert src.keys() - {"lm_head.weight"} == dst.keys() - {"lm_head.weight"}
    d = fwd.cfg.embed
    for k in src.keys() & dst.keys():
        a, b = src[k], dst[k]
        if k.endswith("attn.c_attn.bias"):  # GPT-2's key bias is dropped on import (exact), written as zeros
            assert (b[d:2 * d] == 0).all()
            a, b = np.concatenate([a[:d], a[2 * d:]]), np.concatenate([b[:d], b[2 * d:]])
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k
    back = type(model).from_pretrained(str(out)).eval()  # and the key bias really is irrelevant
    close(hf_logits(back, TOKENS), hf_logits(model, TOKENS))


def test_export_after_training_at_2_1_4_loads_in_transformers(models, corpus, tmp_path):
    """llama (GQA, untied, llama3 RoPE): 2 steps of 1F1B at (2,1,4) from the HF weights, `--format hf` export, then
    `from_pretrained` gives jaxpar's logits of the trained params; the tokenizer round-trips through AutoTokenizer."""
    model, single, _ = models["llama"]
    over = {"mesh.data": 2, "mesh.tensor": 1, "mesh.stage": 4, "train.microbatches": 4, "pipeline.schedule": "1f1b",
            "init_from": f"hf:{single}", "train.steps": 2, "checkpoint.every_steps": 2}
    wd = tmp_path / "run"
    trainer.run(run_config(corpus, tmp_path, **over), str(wd))
    assert export_main(["--workdir", str(wd), "--out", str(tmp_path / "hf"), "--format", "hf",
                        "--max_shard_size", "30KB"]) == 0
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    run = runs.load_run(str(wd))
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(trained).__name__ == "LlamaForCausalLM"
    close(hf_logits(trained, TOKENS), logits_of(run.fwd, run.params, TOKENS, V))
    assert np.abs(hf_logits(trained, TOKENS) - hf_logits(model, TOKENS)).max() > 1e-3  # it did train
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "To be, or not to be: ünïcødé"
    assert auto(text, add_special_tokens=False)["input_ids"] == run.tokenizer.encode(text)


def test_greedy_decoding_equals_transformers_generate_and_the_cli_samples(models):
    """jaxpar's KV-cache greedy decoding of the imported llama (GQA, llama3 RoPE) gives transformers' `generate`
    tokens; `sample.py --workdir hf:DIR` runs on it."""
    import subprocess
    import sys

    from jaxpar.generate.engine import Engine, Request

    model, single, _ = models["llama"]
    fwd, params, _ = hf.load(str(single))
    prompt = TOKENS[:2, :5]
    ours = [p.tolist() + c.tokens for p, c in zip(prompt, Engine(fwd, params).generate(
        [Request(prompt=p.tolist(), max_new_tokens=8) for p in prompt]))]
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=8, min_new_tokens=8,
                                do_sample=False)
    np.testing.assert_array_equal(np.asarray(ours), theirs.numpy())
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "sample.py", "--workdir", f"hf:{single}", "--prompt", "ab", "--new_tokens", "6",
                        "--temperature", "0"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ab"), r.stderr[-2000:]


def test_llama3_rope_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0,
                                   max_position_embeddings=131072,
                                   rope_scaling={**ROPE, "factor": 8.0, "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_frequencies(128, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_len": 8192})
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert (got < rope_frequencies(128, 500000.0)).any()  # the scaling changed something


def edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(changes)
    with open(path, "w") as f:
        json.dump(c, f)


def test_rope_settings_read_from_either_spelling(models, tmp_path):
    _, single, _ = models["llama"]
    legacy = tmp_path / "legacy"
    shutil.copytree(single, legacy)
    with open(legacy / "config.json") as f:
        c = json.load(f)
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope
    with open(legacy / "config.json", "w") as f:
        json.dump(c, f)
    assert hf.settings(str(legacy)) == {**hf.settings(str(single)), "data.tokenizer": str(legacy / "tokenizer.json")}
    assert hf.settings(str(single))["model.rope_scaling"] == "llama3"


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, r"architectures \['MistralForCausalLM'\]"),
    ({"attention_bias": True}, r"attention_bias=true"),
    ({"mlp_bias": True}, r"mlp_bias=true"),
    ({"head_dim": 16}, r"head_dim=16 .* needs head_dim = hidden_size / num_attention_heads = 8"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"RoPE type 'yarn'"),
    ({"num_key_value_heads": 3}, r"model.kv_heads=3 does not divide model.heads=4"),
    ({"vocab_size": 200}, r"has 256 symbols but the embedding has only vocab_size=200"),
    ({"hidden_size": None}, r"config.json: a value of the wrong type"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, r"RoPE type 'linear'; jaxpar"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'; jaxpar's llama MLP is SwiGLU"),
    ({"num_attention_heads": 0}, r"num_attention_heads=0; jaxpar needs head_dim"),
    ({"intermediate_size": 64}, r"tensor 'model.layers.0.mlp.gate_proj.weight' is \[48, 32\], but config.json "
                                r"implies \[64, 32\]"),
])
def test_bad_config_is_refused_before_anything_is_written(models, corpus, tmp_path, change, match):
    bad = copy(models["llama"][1], tmp_path / "bad")
    edit_config(bad, **change)
    wd = tmp_path / "run"
    with pytest.raises(ConfigError, match=match) as refused:
        trainer.run(run_config(corpus, tmp_path, **{"init_from": f"hf:{bad}"}), str(wd))
    assert not wd.exists()
    # what is refused and why, once: a feature refusal is not called a type error, and names the file once
    msg = str(refused.value)
    assert msg.count(str(bad / "config.json")) <= 1, msg
    assert ("wrong type" in msg) == ("wrong type" in match), msg


def test_missing_or_truncated_shard_is_refused(models, corpus, tmp_path):
    _, _, sharded = models["gpt2"]
    shards = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    missing = copy(sharded, tmp_path / "missing")
    os.remove(missing / shards[1])
    truncated = copy(sharded, tmp_path / "truncated")
    with open(truncated / shards[2], "r+b") as f:
        f.truncate(os.path.getsize(truncated / shards[2]) - 10)
    bin_only = copy(sharded, tmp_path / "bin_only")  # a PyTorch-pickle checkpoint: no safetensors
    for n in os.listdir(bin_only):
        if ".safetensors" in n:
            os.remove(bin_only / n)
    (bin_only / "pytorch_model.bin").write_bytes(b"not read")
    for d, match in ((missing, rf"{shards[1]} is missing"), (truncated, rf"{shards[2]} is truncated"),
                     (bin_only, r"safetensors")):
        wd = tmp_path / f"run_{d.name}"
        with pytest.raises(ConfigError, match=match):
            trainer.run(run_config(corpus, tmp_path, **{"init_from": f"hf:{d}"}), str(wd))
        assert not wd.exists()
        # refused before the corpus was tokenized: no prepared data in the cache
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_export_names_the_end_of_text_token_for_auto_tokenizer(tmp_path):
    """A BPE tokenizer's end-of-text id is in config.json (bos/eos ids) and by name in tokenizer_config.json, so
    `AutoTokenizer` reports it and `generate` can stop on it; the byte tokenizer, which has none, names none."""
    bpe = BPETokenizer.train(["to be or not to be, that is the question\n"] * 50, vocab_size=300)
    cfg = ModelConfig(vocab_size=384, vocab_real=bpe.vocab_size, seq_len=8, layers=1, embed=16, heads=2, mlp=32)
    params = jax.device_get(init_params(cfg, jax.random.key(0)))
    for tok, name in ((bpe, "bpe"), (ByteTokenizer(), "byte")):
        out = tmp_path / name
        out.mkdir()
        hf.save(params, cfg, tok, str(out), "float32", 1 << 30)
        auto = transformers.AutoTokenizer.from_pretrained(str(out))
        meta = json.loads((out / "config.json").read_text())
        assert auto.eos_token_id == meta["eos_token_id"] == tok.eot_id
        if tok.eot_id is not None:
            assert auto.eos_token == auto.bos_token == auto.convert_ids_to_tokens(tok.eot_id)
