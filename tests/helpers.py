"""Shared test utilities: tiny configs, synthetic batches, the relative-L2 comparison, and the one meaning of "equal to
the 1-device run" (float32 before the optimizer, float64 after it), with session-wide caches of the reference runs."""
import hashlib
import json
import os
import pathlib
import struct
import sys

import jax
import numpy as np

from jaxpar import config as jcfg
from jaxpar.compiled import steps_for  # noqa: F401 (the tests' one way to build a config's steps)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**over):
    c = jcfg.base_config()
    c.model.update(seq_len=16, layers=4, embed=32, heads=8, mlp=64)
    c.train.update(global_batch_size=16, microbatches=1, steps=3)
    c.optim.update(lr=1e-3, warmup_steps=0, decay_steps=10, clip_norm=1.0)
    for k, v in over.items():
        if "." in k:
            sect, key = k.split(".")
            c[sect][key] = v
        else:
            c[k] = v
    return c


VOCAB = 250  # not a multiple of 128: every test model pads its vocabulary


def pipe_config(data=1, tensor=1, stage=1, schedule="gpipe", v=1, M=8, **over):
    c = tiny_config(**{"model.layers": 8, "train.microbatches": M, "mesh.data": data, "mesh.tensor": tensor,
                       "mesh.stage": stage, "pipeline.schedule": schedule, "pipeline.virtual_stages": v, **over})
    return c


def microbatches_for(data: int) -> int:
    """8 microbatches (>= every stage count here) where batch 16 allows it at this data size, else 16 / data."""
    return 8 if 16 % (data * 8) == 0 else 16 // data


def batch(n, seq, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, vocab, (n, seq + 1), dtype=np.int32)}


def place(steps, b):
    return jax.tree.map(lambda a: jax.device_put(a, steps.batch_sharding), b)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_trees_close(a, b, tol=1e-5):
    fa, _ = jax.tree_util.tree_flatten_with_path(a)
    fb = jax.tree.leaves(b)
    assert len(fa) == len(fb)
    for (path, x), y in zip(fa, fb):
        e = rel_l2(x, y)
        assert e <= tol, f"{jax.tree_util.keystr(path)}: relative L2 {e:.3g} > {tol}"


def run_config(corpus, tmp_path, **over):
    c = tiny_config(**over)
    c.data.update(sources=str(corpus / "*.txt"), tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    c.train.steps = over.get("train.steps", 6)
    c.log.update(every_steps=1, progress=False)
    c.eval.update(every_steps=100, batches=1)
    c.checkpoint.update(every_steps=3, keep=3, async_save=True)
    return c


# "Equal to the 1-device run", compared in float64 on both sides (JAX's x64 mode; `train.param_dtype =
# compute_dtype = "float64"`, which every layout, schedule and ZeRO stage runs), from one compiled program per side
# (`Steps.train_with_grads`): the first step's gradients, the losses and the params after each AdamW step. In
# float32, AdamW's first updates (about lr * g / |g| per element) move an element whose gradient is rounding noise a
# whole learning rate either way, so a float32 comparison measures the CPU's summation order (an AVX-512 machine
# failed a float32 bound that AVX2 passed). In float64 the rounding is 2^29 times finer: measured, every layout's
# params after 3 AdamW steps are within 3e-15 relative L2 of the 1-device float64 run, and nothing in float64
# (softmax, loss sums, gradient buffers) is computed in float32. F64_TOL = 1e-9 leaves a margin of >10^5 over that,
# on any instruction set, while a real layout bug (a dropped microbatch, a wrong ZeRO shard of the Adam moments,
# layers out of order) moves the elements it touches by O(lr): relative errors of 1e-3 to 1, six orders of magnitude
# above the bound (tests/test_layouts.py checks one). Float32 runs on other layouts are the trainer's, resume and
# multi-process tests.
F64_TOL = 1e-9
LOSS_F64_RTOL = 1e-12


def reference_config(config):
    """The same run on 1 device, unpipelined, one microbatch, ZeRO 0, a MoE through its fixed buffers: layout
    settings (and the MoE implementation) change only the order of sums."""
    c = config.copy_and_resolve_references()
    c.model.moe_impl = "buffers"
    c.mesh.update(data=1, tensor=1, stage=1, expert=1, context=1)
    c.train.microbatches = 1
    c.optim.zero_stage = 0
    c.pipeline.update(schedule="gpipe", virtual_stages=1)
    c.model.sequence_parallel = False
    return c


def float64_config(config):
    c = config.copy_and_resolve_references()
    c.train.update(param_dtype="float64", compute_dtype="float64")
    return c


def _key(config, vocab, batches) -> str:
    h = hashlib.sha256(config.to_json().encode() + str(vocab).encode())
    for b in batches:
        for k in sorted(b):
            h.update(k.encode() + np.ascontiguousarray(b[k]).tobytes())
    return h.hexdigest()


_CACHE = {}


def _cached(kind, config, vocab, batches, fn):
    key = (kind, _key(config, vocab, batches))
    if key not in _CACHE:
        _CACHE[key] = fn()
    return _CACHE[key]


def float64_run(config, vocab, batches, devices=None):
    """(losses, params in canonical layer order, the gradients of the first step, each step's metrics on the host)
    after one float64 train step per batch on `config`'s layout: one compiled program (`Steps.train_with_grads`)."""
    n = config.mesh.data * config.mesh.tensor * config.mesh.stage * config.mesh.expert * config.mesh.context
    with jax.enable_x64(True):
        s = steps_for(float64_config(config), vocab, jax.devices()[:n] if devices is None else devices)
        state, losses, first, metrics = s.init(0), [], None, []
        for b in batches:
            state, m, g = s.train_with_grads(state, place(s, b))
            losses.append(float(m["loss"]))
            metrics.append(jax.device_get(m))
            first = jax.device_get(g) if first is None else first
        return losses, jax.device_get(s.to_canonical(state)["params"]), first, metrics


def float64_train(config, vocab, batches, devices=None):
    """(losses, params in canonical layer order) after one float64 train step per batch on `config`'s layout."""
    return float64_run(config, vocab, batches, devices)[:2]


def reference_run(config, vocab, batches):
    """`float64_run` of the 1-device run (`reference_config`), cached for the whole test session."""
    c = reference_config(config)
    return _cached("train", c, vocab, batches, lambda: float64_run(c, vocab, batches, jax.devices()[:1]))


def reference_train(config, vocab, batches):
    """`float64_train` of the 1-device run (`reference_config`), cached for the whole test session."""
    return reference_run(config, vocab, batches)[:2]


def assert_equals_one_device(config, vocab, batches):
    """`config`'s layout computes the 1-device run, from one compiled program per side: the loss and gradients of
    the first step (before any update) and the losses and params after one AdamW step per batch, all in float64
    (see F64_TOL: losses within 1e-12, every gradient and parameter tensor within 1e-9 relative L2).
    -> the layout's (float64 losses, params)."""
    losses, params, grads = float64_run(config, vocab, batches)[:3]
    r_losses, r_params, r_grads = reference_run(config, vocab, batches)[:3]
    assert_params_exact(grads, r_grads)
    assert_params_exact(params, r_params)
    np.testing.assert_allclose(losses, r_losses, rtol=LOSS_F64_RTOL)
    return losses, params


def assert_params_exact(p, p_ref, tol=F64_TOL):
    """Every float64 tensor of `p` within `tol` relative L2 of `p_ref` (see F64_TOL).

    With JAXPAR_PARAM_ERRORS=path, appends each tensor's relative error and its share of the bound as JSON lines."""
    fa, _ = jax.tree_util.tree_flatten_with_path(p)
    fr = jax.tree.leaves(p_ref)
    assert len(fa) == len(fr)
    log = os.environ.get("JAXPAR_PARAM_ERRORS")
    for (path, x), y in zip(fa, fr):
        x, y = np.asarray(x), np.asarray(y)
        if not np.issubdtype(y.dtype, np.floating):  # counters (Adam's step count) are equal or wrong
            assert np.array_equal(x, y), f"{jax.tree_util.keystr(path)}: {x} != {y}"
            continue
        assert x.dtype == y.dtype == np.float64, f"{jax.tree_util.keystr(path)}: compare float64 runs"
        e = rel_l2(x, y)
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"leaf": jax.tree_util.keystr(path), "rel_err": e, "of_bound": e / tol}) + "\n")
        assert e <= tol, f"{jax.tree_util.keystr(path)}: relative L2 {e:.3g} > {tol} (float64 on both sides)"


BATCHES = [batch(16, 16, VOCAB)] * 3  # the pipeline and layout tests' three steps


def command(corpus, tmp_path, steps):
    return [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/shakespeare.py"),
            "--workdir", str(tmp_path / "run"), f"--config.data.sources={corpus}/*.txt",
            f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.model.layers=2", "--config.model.embed=32",
            "--config.model.mlp=64", "--config.model.seq_len=16", "--config.train.global_batch_size=8",
            f"--config.train.steps={steps}", "--config.checkpoint.every_steps=100000", "--config.log.every_steps=1",
            "--config.eval.every_steps=100000", "--config.eval.batches=1", "--config.log.progress=False"]


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def write_jsonl(path, records):
    """`records` (dicts) as a JSONL file at `path` -> path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def records_config(tmp_path, src, **over):
    """A tiny SFT run (data 8) over the record file `src`, with the tokenizer of tmp_path/tok, packed bfd."""
    c = tiny_config(**{"mesh.data": 8, "train.global_batch_size": 8, **over})
    c.data.update(sources=str(src), tokenizer=str(tmp_path / "tok" / "tokenizer.json"), packing="bfd",
                  cache_dir=str(tmp_path / "cache"))
    return c


CHAT_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<think>", "</think>")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
          "{{ m['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")  # with generation markers


def released_template(name: str) -> str:
    """A released model's chat template, as TRL's wheel ships it (package data trl/chat_templates/NAME.jinja: its
    byte-exact copies of the models' templates and its `*_training` ones with `{% generation %}` markers); the
    calling test is skipped where trl (jaxpar[interop]) is not installed."""
    import importlib.resources

    import pytest

    pytest.importorskip("trl", reason="released chat templates are read from trl's package data: "
                                      "pip install -e '.[interop]'")
    return (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


def chat_tokenizer(directory, template: str = CHATML, bos: str | None = "<|endoftext|>", eos: str = "<|im_end|>",
                   texts=("What is 2+2? It is 4. The quick brown fox jumps over the lazy dog.\n" * 4,
                          "system user assistant: be brief, hello world, the answer is")):
    """A small byte-level BPE tokenizer.json with chat templates' special tokens, and a tokenizer_config.json with
    `template` and the special tokens: what a Hugging Face chat checkpoint's directory holds."""
    from jaxpar.data import BPETokenizer

    os.makedirs(directory, exist_ok=True)
    tok = BPETokenizer.train(list(texts), 400, CHAT_SPECIAL)
    tok.save(directory)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": eos}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config | ({"bos_token": bos} if bos else {}), f)
    return tok


def random_hf_llama(directory, tok, seed: int = 0, **shape):
    """A random Llama of `shape` (`ModelConfig` fields over a tiny default) saved as a Hugging Face directory by
    jaxpar's own writer (`interop.hf.save`, no torch needed): config.json, model.safetensors, and `tok` (a tokenizer
    loaded from a directory, its chat template and special tokens beside it)."""
    from jaxpar.formats import hf
    from jaxpar.model import ModelConfig, init_params

    cfg = ModelConfig(**{"vocab_size": jcfg.padded_vocab(tok.vocab_size, 1), "vocab_real": tok.vocab_size,
                         "seq_len": 128, "layers": 2, "embed": 32, "heads": 4, "kv_heads": 2, "mlp": 64, "arch": "llama",
                         "tie_embeddings": False, "max_positions": 256, **shape})
    os.makedirs(directory, exist_ok=True)
    hf.save(jax.device_get(init_params(cfg, jax.random.key(seed))), cfg, tok, str(directory), "float32", 10 ** 9)
    return cfg


def float64_oracle(model):
    """`model` computing in float64 throughout. transformers computes RoPE's cos/sin, RMSNorm and the router's
    softmax in float32 whatever the model's dtype (relative errors of 1e-7 in the loss), which would make no float64
    oracle: those three run in float64 here (the same formulas; RoPE's inverse frequencies stay the float32 numbers
    both libraries define them as), attention through SDPA (no float32 softmax), experts one by one."""
    import torch

    model.set_attn_implementation("sdpa")
    if getattr(model.config, "num_experts", 0):
        model.set_experts_implementation("eager")  # (grouped_mm runs in float32 only)
    inv = model.model.rotary_emb.inv_freq.double()

    def rope(x, position_ids):
        freqs = position_ids[:, :, None].double() * inv[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms_norm(norm):
        return lambda x: norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    def router(gate):
        def forward(x):
            logits = torch.nn.functional.linear(x.reshape(-1, gate.hidden_dim), gate.weight)
            top, idx = torch.topk(torch.softmax(logits, dim=-1), gate.top_k, dim=-1)
            return logits, top / top.sum(-1, keepdim=True) if gate.norm_topk_prob else top, idx
        return forward

    model.model.rotary_emb.forward = rope
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = rms_norm(m)
        elif type(m).__name__.endswith("TopKRouter"):
            m.forward = router(m)
    return model


def wandb_records(path):
    """The protobuf records of a W&B run file (`run-ID.wandb`): wandb's transaction log, LevelDB's log format (a
    7-byte header ":W&B", then 32 KiB blocks of chunks: crc32, length, type full/first/middle/last), parsed as wandb's
    own `Record` messages."""
    from wandb.proto import wandb_internal_pb2

    raw, block = open(path, "rb").read(), 32768
    assert raw[:4] == b":W&B", raw[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec
        elif kind == 0:
            break


def wandb_history(directory) -> dict:
    """{run id: [(W&B's _step, the logged `step`, loss), ...]} from the offline run files under DIRECTORY/wandb (a
    WORKDIR, or `$WANDB_DIR`), in the order logged."""
    out = {}
    for f in sorted(pathlib.Path(directory, "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if "loss" in items:
                    out.setdefault(f.stem[len("run-"):], []).append((items["_step"], items["step"], items["loss"]))
    return out


# two layouts that DPO's and GRPO's float64 comparisons with the formula run on: (2,2,2) 1F1B, (4,2,1) ZeRO 3
EQUIVALENT_LAYOUTS = {
    "1f1b_2x2x2": {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "pipeline.schedule": "1f1b",
                   "train.microbatches": 4},
    "zero3_4x2x1": {"mesh.data": 4, "mesh.tensor": 2, "train.microbatches": 2, "optim.zero_stage": 3}}


def float64_llamas(tmp_path_factory, vocab: int):
    """(policy dir, reference dir, policy model, reference model): two random float64 Llamas of one shape (seeds
    0, 1; norm scales away from 1), written with a byte tokenizer (DPO's and GRPO's references)."""
    import torch
    import transformers
    from jaxpar.data import ByteTokenizer
    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=False,
                  rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).double()
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
        d = tmp_path_factory.mktemp(f"m{seed}")
        m.save_pretrained(d)
        ByteTokenizer.to_hf().save(str(d / "tokenizer.json"))
        out.append((d, float64_oracle(m.eval())))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def random_groups(rng, prompts: int, group: int, vocab: int):
    """`prompts` random prompts of 3-6 token ids, each repeated for its `group` completions of 2-8 ids: (the prompt of
    each row, each row's completion), GRPO's round layout."""
    rows, completions = [], []
    for _ in range(prompts):
        p = rng.integers(1, vocab, rng.integers(3, 7)).tolist()
        for _ in range(group):
            rows.append(p)
            completions.append(rng.integers(1, vocab, rng.integers(2, 9)).tolist())
    return rows, completions
