"""LoRA adapters: PEFT's format in and out (the reference: `peft` on `transformers`, tiny random Llama and Qwen3 whose
adapters have A and B random, so nothing is zero), training equal to the 1-device run (float64) on pipelined, ZeRO-3
and expert-parallel layouts with the base bitwise unchanged, optimizer state and gradients of the adapters only, and
bad input refused before anything is compiled or written."""
import copy
import json
import os
import shutil

import jax
import numpy as np
import pytest

try:  # the `interop` extra: only the tests against peft need it (the fixture `checkpoints` skips them without it)
    import peft
    import torch
    import transformers
except ImportError:
    peft = torch = transformers = None

from helpers import (BATCHES, VOCAB, assert_equals_one_device, float64_config, pipe_config, run_config,  # noqa: E402
                     steps_for, tiny_config)
from jaxpar import model as gpt, trainer  # noqa: E402
from jaxpar.compiled import report_for  # noqa: E402
from jaxpar.config import ConfigError  # noqa: E402
from jaxpar.data import ByteTokenizer  # noqa: E402
from jaxpar.export import main as export_main  # noqa: E402
from jaxpar.formats import hf, peft as jpeft  # noqa: E402
from jaxpar.state import runs  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_lora")

V = 300
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
              bos_token_id=0, eos_token_id=0)
MODELS = {"llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
          "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=16))}
TOKENS = np.random.default_rng(0).integers(0, V, (4, 17)).astype(np.int32)


def randomize(model, lora_only=False):
    with torch.no_grad():  # norm scales away from 1, adapters' B nonzero: nothing hides a mistake
        for name, p in model.named_parameters():
            if lora_only and "lora_" not in name:
                continue
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: (base directory, adapter directory, the PEFT model)}: random base, random r=4 adapters on every
    projection (rsLoRA for qwen3)."""
    for name in ("torch", "transformers", "peft"):
        pytest.importorskip(name)
    out = {}
    for kind, make in MODELS.items():
        d = tmp_path_factory.mktemp(kind)
        torch.manual_seed(0)
        base = randomize(make()).eval()
        base.save_pretrained(d / "base")
        ByteTokenizer.to_hf().save(str(d / "base" / "tokenizer.json"))
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL, use_rslora=kind == "qwen3",
                              task_type="CAUSAL_LM")
        model = randomize(peft.get_peft_model(copy.deepcopy(base), cfg), lora_only=True)
        model.save_pretrained(d / "adapter")
        out[kind] = (d / "base", d / "adapter", model.eval())
    return out


def lora_config(base, **over):
    c = tiny_config(**{"mesh.data": 1, "init_from": f"hf:{base}", **over})
    return jpeft.apply(hf.apply(c, say=False), say=False)


def placed_params(config, adapter, devices=1):
    """The base from the checkpoint and the adapters from `adapter` on `config`'s layout (`steps`, params)."""
    s = steps_for(config, V, jax.devices()[:devices])
    base = hf.load_params(config.init_from[3:], s.cfg, s.state_shardings["params"], s.layer_order)
    adapters = jpeft.load(str(adapter), s.cfg, gpt.trainable(s.abstract_state()["params"], s.cfg), s.layer_order)
    return s, gpt.merge_trainable(adapters, base)


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_peft_adapter_gives_peft_logits_and_loss(checkpoints, kind):
    from hf_checks import close, hf_logits, logits_of

    base, adapter, model = checkpoints[kind]
    config = lora_config(base, **{"lora.adapter": str(adapter)})
    assert (config.lora.rank, config.lora.alpha, config.lora.rslora) == (4, 8.0, kind == "qwen3")
    s, params = placed_params(config, adapter)
    want = hf_logits(model, TOKENS)
    close(logits_of(s.fwd, params, TOKENS, V), want)
    # the loss on a (2,2,2) 1F1B layout (adapters placed there) equals PEFT's cross-entropy
    c8 = lora_config(base, **{"lora.adapter": str(adapter), "mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2,
                              "train.microbatches": 2, "pipeline.schedule": "1f1b"})
    s8, p8 = placed_params(c8, adapter, 8)
    lsum, n = s8.evaluate(p8, {"tokens": jax.device_put(TOKENS, s8.batch_sharding)})
    ref = torch.nn.functional.cross_entropy(torch.tensor(want[:, :-1]).reshape(-1, V),
                                            torch.tensor(TOKENS[:, 1:], dtype=torch.long).reshape(-1))
    np.testing.assert_allclose(float(lsum) / float(n), float(ref), rtol=1e-5)


def test_after_training_the_peft_and_merged_exports_give_jaxpars_logits(checkpoints, corpus, tmp_path):
    """LoRA (every projection) from the HF base on (2,2,2) 1F1B: the base bitwise unchanged; `--format peft` loads
    with `PeftModel.from_pretrained` and `--format hf` (merged) with plain transformers, both with jaxpar's logits."""
    from hf_checks import close, hf_logits, logits_of

    base, _, _ = checkpoints["llama"]
    over = {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "train.microbatches": 2, "pipeline.schedule": "1f1b",
            "init_from": f"hf:{base}", "train.steps": 3, "lora.rank": 4, "lora.alpha": 16.0,
            "lora.targets": "all-linear", "optim.lr": 1e-2, "optim.warmup_steps": 0}
    wd = tmp_path / "run"
    trainer.run(run_config(corpus, tmp_path, **over), str(wd))
    run = runs.load_run(str(wd))
    adapters, trained_base = gpt.split_adapters(jax.device_get(run.params))
    _, original, _ = hf.load(str(base))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(trained_base)[0], jax.tree.leaves(original)):
        assert np.array_equal(a, b), f"{jax.tree_util.keystr(path)} changed"
    assert all(np.abs(b).max() > 0 for b in jax.tree.leaves(adapters))  # B trained away from zero
    ours = logits_of(run.fwd, run.params, TOKENS, V)
    assert export_main(["--workdir", str(wd), "--out", str(tmp_path / "peft"), "--format", "peft"]) == 0
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 16.0 and sorted(saved["target_modules"]) == sorted(ALL)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(base))
    with_adapter = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "peft")).eval()
    close(hf_logits(with_adapter, TOKENS), ours)
    assert export_main(["--workdir", str(wd), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    close(hf_logits(merged, TOKENS), ours)
    assert not any("lora" in k for k in merged.state_dict())
    # the checkpoint (base, adapters, their AdamW state) resumes onto another layout
    more = {**over, "mesh.data": 8, "mesh.tensor": 1, "mesh.stage": 1, "pipeline.schedule": "gpipe",
            "train.steps": 4, "train.microbatches": 1}
    trainer.run(run_config(corpus, tmp_path, **more), str(wd))
    resumed = runs.load_run(str(wd))
    assert resumed.step == 4 and not np.array_equal(jax.tree.leaves(gpt.split_adapters(resumed.params)[0])[0],
                                                    jax.tree.leaves(adapters)[0])
    for a, b in zip(jax.tree.leaves(gpt.split_adapters(jax.device_get(resumed.params))[1]),
                    jax.tree.leaves(original)):
        assert np.array_equal(a, b)


def lora_pipe(**over):
    c = pipe_config(**over)
    c.model.update(arch="llama", kv_heads=4)
    c.lora.update(rank=4, alpha=8.0, targets="all-linear")
    return c


LAYOUTS = {"1f1b_2x2x2": dict(data=2, tensor=2, stage=2, schedule="1f1b", M=4),
           "zero3_4x2x1": dict(data=4, tensor=2, M=2, **{"optim.zero_stage": 3})}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_training_equals_one_device_and_leaves_the_base_bitwise(name):
    c = lora_pipe(**LAYOUTS[name])
    _, params = assert_equals_one_device(c, VOCAB, BATCHES)
    with jax.enable_x64(True):
        s = steps_for(float64_config(c), VOCAB, jax.devices()[:8])
        start = jax.device_get(s.to_canonical(s.init(0))["params"])
    for a, b in zip(jax.tree.leaves(gpt.split_adapters(params)[1]), jax.tree.leaves(gpt.split_adapters(start)[1])):
        assert np.array_equal(a, b)
    assert not np.array_equal(jax.tree.leaves(gpt.split_adapters(params)[0])[0],
                              jax.tree.leaves(gpt.split_adapters(start)[0])[0])


def test_expert_parallel_lora_on_the_experts_equals_one_device():
    c = tiny_config(**{"model.arch": "llama", "model.kv_heads": 4, "model.experts": 4, "model.experts_per_token": 2,
                       "mesh.data": 2, "mesh.expert": 4, "train.microbatches": 2})
    c.lora.update(rank=4, targets="q_proj,v_proj,w1,w2,w3")
    s = steps_for(c, VOCAB, jax.devices()[:8])
    lora_leaves = gpt.split_adapters(s.abstract_state()["params"])[0]["blocks"]
    assert set(lora_leaves["moe"]["experts"]["lora"]) == {"w_gate", "w_up", "w_down"}
    assert_equals_one_device(c, VOCAB, [BATCHES[0]] * 2)


def test_optimizer_state_and_gradients_scale_with_the_adapters_only():
    """The compile report: with LoRA the AdamW moments are 2 x the adapters' bytes and the gradient buffer 1 x (the
    base has none); without, both scale with the whole model."""
    full = tiny_config(**{"model.arch": "llama", "model.kv_heads": 4, "mesh.data": 1})
    lor = tiny_config(**{"model.arch": "llama", "model.kv_heads": 4, "mesh.data": 1, "lora.rank": 2})
    reps = {k: report_for(c, VOCAB, jax.devices()[:1]) for k, c in (("full", full), ("lora", lor))}
    s = steps_for(lor, VOCAB, jax.devices()[:1])
    adapters = sum(a.size * 4 for a in jax.tree.leaves(gpt.split_adapters(s.abstract_state()["params"])[0]))
    assert reps["lora"]["layout"]["trainable"] * 4 == adapters > 0
    assert reps["lora"]["state_bytes"]["grad_buffer"] == adapters
    assert adapters * 2 <= reps["lora"]["state_bytes"]["opt_state"] <= adapters * 2 + 64
    assert reps["full"]["state_bytes"]["opt_state"] >= 2 * reps["full"]["state_bytes"]["params"]
    assert reps["lora"]["state_bytes"]["params"] == reps["full"]["state_bytes"]["params"] + adapters


def refused(config, workdir, match):
    with pytest.raises(ConfigError, match=match):
        trainer.run(config, str(workdir), devices=jax.devices()[:1])
    assert not os.path.exists(workdir)


def test_bad_lora_input_is_refused_before_anything_is_written(checkpoints, corpus, tmp_path):
    base, adapter, _ = checkpoints["llama"]
    _, qwen_adapter, _ = checkpoints["qwen3"]
    c = lambda **o: run_config(corpus, tmp_path, **{"mesh.data": 1, "init_from": f"hf:{base}", **o})  # noqa: E731
    refused(c(**{"lora.targets": "q_proj"}), tmp_path / "a", r"lora.targets='q_proj' with lora.rank=0")
    refused(c(**{"lora.rank": 4, "lora.targets": "q_proj,c_attn"}), tmp_path / "b",
            r"c_attn names no weight of this llama model")
    refused(c(**{"lora.adapter": str(qwen_adapter)}), tmp_path / "c",
            r"q_proj.lora_A.weight has shape \[4, 32\], this model needs|lora_B.weight has shape")
    dora = tmp_path / "dora"
    shutil.copytree(adapter, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    refused(c(**{"lora.adapter": str(dora)}), tmp_path / "d", r"use_dora=True is not supported")


MORE_LAYOUTS = {"context_2x4": {"mesh.data": 2, "mesh.context": 4},
                "sp_dropout_offload_4x2": {"mesh.data": 4, "mesh.tensor": 2, "model.sequence_parallel": True,
                                           "lora.dropout": 0.1, "optim.offload": "optimizer", "optim.zero_stage": 1}}


@pytest.mark.parametrize("name", list(MORE_LAYOUTS))
def test_lora_under_context_sequence_parallel_dropout_and_offload_equals_one_device(name):
    c = tiny_config(**{"model.arch": "llama", "model.kv_heads": 4, **MORE_LAYOUTS[name]})
    c.lora.update(rank=4, alpha=8.0, targets="all-linear", dropout=c.lora.dropout)
    assert_equals_one_device(c, VOCAB, BATCHES)


def test_a_bf16_base_halves_the_frozen_weights_and_keeps_the_adapters_float32():
    over = {"model.arch": "llama", "model.kv_heads": 4, "mesh.data": 1, "lora.rank": 2}
    reps = {dt: report_for(tiny_config(**over, **{"lora.base_dtype": dt}), VOCAB, jax.devices()[:1])
            for dt in ("", "bfloat16")}
    s = steps_for(tiny_config(**over, **{"lora.base_dtype": "bfloat16"}), VOCAB, jax.devices()[:1])
    adapters, base = gpt.split_adapters(s.abstract_state()["params"])
    assert {a.dtype for a in jax.tree.leaves(adapters)} == {np.dtype("float32")}
    assert {a.dtype for a in jax.tree.leaves(base)} == {np.dtype(jax.numpy.bfloat16)}
    base_bytes = sum(a.size for a in jax.tree.leaves(base)) * 2
    assert reps[""]["state_bytes"]["params"] - reps["bfloat16"]["state_bytes"]["params"] == base_bytes
