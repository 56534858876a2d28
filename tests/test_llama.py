"""The llama family under every kind of layout: each equals the 1-device run (`helpers.assert_equals_one_device`: the
first step's gradients, losses and params after 3 AdamW steps, float64); a checkpoint resumes
onto another layout; KV-cache decoding equals the uncached forward, token by token, for both families, with
grouped-query attention."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_equals_one_device, run_config, tiny_config
from jaxpar import model as gpt
from jaxpar import trainer
from jaxpar.config import ConfigError
from jaxpar.validate import validate
from jaxpar.generate.engine import Engine, Request
from helpers import BATCHES, VOCAB, microbatches_for, pipe_config
from helpers import losses

# heads 8, kv_heads 2: four query heads per KV head; at tensor 2 the KV heads split, at tensor 4 each is replicated
LLAMA = {"model.arch": "llama", "model.kv_heads": 2, "model.tie_embeddings": False}
# (circular shares GPipe's engine, and the pipeline knows no model: its other layouts are test_pipeline's)
CASES = [((2, 2, 2), "gpipe", {}), ((2, 1, 4), "1f1b", {}), ((1, 2, 4), "zb_h1", {}),
         ((4, 2, 1), "gpipe", {"optim.zero_stage": 3}), ((2, 2, 2), "1f1b", {"pipeline.virtual_stages": 2}),
         ((2, 4, 1), "gpipe", {})]


@pytest.mark.parametrize("layout,schedule,over", CASES, ids=lambda x: str(x))
def test_llama_layout_equals_one_device(layout, schedule, over):
    d, t, s = layout
    assert_equals_one_device(pipe_config(d, t, s, schedule, over.get("pipeline.virtual_stages", 1),
                                         M=microbatches_for(d), **LLAMA, **over), VOCAB, BATCHES)


def test_kv_heads_that_neither_split_nor_replicate_are_refused():
    c = tiny_config(**{**LLAMA, "model.embed": 48, "model.heads": 12, "model.mlp": 96, "model.kv_heads": 4,
                       "mesh.data": 1, "mesh.tensor": 6})
    with pytest.raises(ConfigError, match=r"model.kv_heads=4 and mesh.tensor=6: .* neither holds"):
        validate(c, 6)
    c = tiny_config(**{**LLAMA, "model.kv_heads": 3, "mesh.data": 1})
    with pytest.raises(ConfigError, match=r"model.kv_heads=3 does not divide model.heads=8"):
        validate(c, 1)
    for kv, t in ((8, 8), (2, 8), (1, 4)):  # split, replicated 4-way, multi-query replicated
        assert validate(tiny_config(**{**LLAMA, "model.kv_heads": kv, "mesh.data": 1, "mesh.tensor": t}), t)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cached_decoding_equals_the_uncached_forward(arch):
    """Greedy tokens and each step's logits from the KV cache equal an argmax over the whole sequence recomputed
    without a cache (fp32: logits within 1e-5 of their scale)."""
    c = tiny_config(**({**LLAMA, "model.rope_scaling": "llama3", "model.rope_original_max_len": 8,
                        "model.rope_factor": 4.0} if arch == "llama" else {}))
    cfg = gpt.config_from(c, VOCAB, 1)
    fwd, params = gpt.Forward(cfg), gpt.init_params(cfg, jax.random.key(1))
    assert cfg.kv_heads == (2 if arch == "llama" else 8)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 5)), jnp.int32)
    got = Engine(fwd, params).generate([Request(prompt=p.tolist(), max_new_tokens=8) for p in np.asarray(prompt)])
    out = jnp.concatenate([prompt, jnp.asarray([c.tokens for c in got], jnp.int32)], axis=1)
    assert fwd.init_cache(2, 13).k.shape == (cfg.layers, 2, 13, cfg.kv_heads, cfg.head_dim)

    # uncached: the whole sequence at once; by causality its logits at position i - 1 are those of out[:, :i]
    full = jax.jit(lambda t: fwd.logits(params, fwd.layers(params["blocks"], fwd.embed(params, t))))(out)
    full = np.asarray(full)[:, :, :VOCAB]
    decode = jax.jit(fwd.decode)
    z, caches = decode(params, prompt, fwd.init_cache(2, 13))
    for i in range(5, 13):
        want = full[:, i - 1]
        np.testing.assert_allclose(np.asarray(z)[:, :VOCAB], want, atol=1e-5 * np.abs(want).max())
        assert (np.argmax(want, -1) == np.asarray(out[:, i])).all()
        z, caches = decode(params, out[:, i:i + 1], caches)


@pytest.mark.slow
def test_llama_checkpoint_resumes_onto_another_layout(corpus, tmp_path):
    """A llama run with dropout at (2,2,2) GPipe, stopped at step 3, resumes at (1,2,4) ZB-H1: step 4's loss equals
    the uninterrupted run's (1e-6 relative: computed from the restored params before any optimizer step on the new
    layout; dropout masks depend on step, layer and sequence, not on the layout)."""
    src, drop = tmp_path / "src", {"model.dropout_embed": 0.1, "model.dropout_resid": 0.1, "train.steps": 4}
    trainer.run(run_config(corpus, tmp_path, **{**LLAMA, **drop, "mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2,
                                                "train.microbatches": 2}), str(src))
    wd = tmp_path / "resumed"
    shutil.copytree(src / "checkpoints" / "3", wd / "checkpoints" / "3")
    trainer.run(run_config(corpus, tmp_path, **{**LLAMA, **drop, "mesh.data": 1, "mesh.tensor": 2, "mesh.stage": 4,
                                                "train.microbatches": 4, "pipeline.schedule": "zb_h1"}), str(wd))
    assert sorted(losses(wd)) == [4]
    np.testing.assert_allclose(losses(wd)[4], losses(src)[4], rtol=1e-6)


def test_flops_count_matmul_parameters_only():
    """6N + 12·L·d·T with N = the matmul weights (q, k, v, o, gate, up, down per layer, and the untied head; not the
    input table, a lookup, nor the norms); tied, the table counts once, as the head."""
    c = tiny_config(**LLAMA)
    L, d, h, kv, f, T = 4, 32, 8, 2, 64, 16
    hd, Vp = d // h, 256
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
    assert gpt.flops_per_token(gpt.config_from(c, VOCAB, 1)) == 6 * (L * per_layer + d * Vp) + 12 * L * d * T
    c.model.tie_embeddings = True
    assert gpt.flops_per_token(gpt.config_from(c, VOCAB, 1)) == 6 * (L * per_layer + Vp * d) + 12 * L * d * T
