"""Defaults for every config key, and the key names: `base_config()`, the logical-axis rules, the small facts every
room reads (`mlp_width`, `padded_vocab`, `mesh_shape`, `step_rules`). Imports nothing of jaxpar, so every room may
import it. The rules that need their owners (model, kernels, loss scale, schedules) are `jaxpar/validate.py`, which
only entry points import.

Config files in `configs/` start from `base_config()` and change what they need.
"""
from __future__ import annotations

import difflib
import math
import re

import ml_collections

from jaxpar.errors import ConfigError  # noqa: F401 (re-exported: raised by every room that checks a config)

# Logical axis -> mesh axis (None: replicated). Megatron's tensor-parallel pattern: heads and MLP width are split
# (column-parallel in, row-parallel out), the vocabulary is split (vocab-parallel embedding and logits); the batch is
# split over data; the stacked layers over stage (the pipeline).
DEFAULT_RULES = (
    ("batch", "data"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),  # llama's KV heads: split when tensor divides them, else replicated (see validate)
    ("mlp", "tensor"),
    ("kv", None),
    ("embed", None),
    ("qkv", None),
    ("seq", None),
    ("act_seq", None),  # the residual stream's sequence (norms, dropout, adds); "tensor" with model.sequence_parallel
    ("layers", "stage"),
)

MESH_AXES = ("data", "stage", "tensor")  # order of the device grid: tensor last = neighbouring devices
REMAT_POLICIES = ("none", "selective", "full", "dots", "attention")
DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: reference runs for tests (see validate._check_float64)




def _model_defaults() -> ml_collections.ConfigDict:
    """The `model` section of `base_config`."""
    return ml_collections.ConfigDict(dict(
        arch="gpt2",  # gpt2 (LayerNorm, learned positions, GELU MLP, biases) | llama (RMSNorm, RoPE, GQA, SwiGLU)
        vocab_size=0,  # 0: taken from the tokenizer; padded to a multiple of 128 and of mesh.tensor
        seq_len=256, layers=4, embed=128, heads=4,
        mlp=0,  # the MLP's hidden width (llama: HF's intermediate_size); 0: 4 * embed
        kv_heads=0,  # llama: grouped-query KV heads, dividing heads; 0: = heads
        max_positions=0,  # gpt2: rows of the position table; llama: context the model is made for; 0: = seq_len
        norm_eps=1e-5,
        rope_theta=10000.0,  # llama: RoPE base
        rope_scaling="none",  # llama: none | llama3 (Llama 3.1/3.2's frequency scaling with the rope_* keys below)
        rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192,
        dropout_embed=0.0, dropout_resid=0.0,
        tie_embeddings=True,
        remat="none",  # none | selective (recompute the attention core only) | full | dots | attention
        attention="auto",  # auto | xla | cudnn | pallas: the attention kernel (jaxpar/attention.py)
        loss_chunk=1024,  # sequence positions per chunk of the LM head + cross-entropy (no whole float32 logits)
        sequence_parallel=False,  # Megatron-SP: the residual stream split on seq over tensor (act_seq -> tensor)
    ))


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "jaxpar"
    c.init_from = ""  # weights to start from: an export directory (python -m jaxpar.export), or hf:DIR (Hugging Face)

    c.mesh = ml_collections.ConfigDict(dict(data=-1, tensor=1, stage=1))
    c.rules = DEFAULT_RULES

    c.model = _model_defaults()

    c.train = ml_collections.ConfigDict(dict(
        steps=1000, global_batch_size=32, microbatches=1, seed=0,
        param_dtype="float32", compute_dtype="float32",
        nonfinite="stop",  # stop | skip: what a non-finite loss or gradient does (fp16 overflows: the loss scale)
        # resume a checkpoint written with another global_batch_size (the data order continues from the samples it
        # consumed; the LR schedule stays a function of the applied updates); default: refuse
        allow_batch_change=False,
        # fp16 dynamic loss scaling, DeepSpeed's defaults (initial 2^16, window 1000, hysteresis 2, min 1)
        loss_scale_initial=2.0 ** 16, loss_scale_window=1000, loss_scale_hysteresis=2, loss_scale_min=1.0,
        loss_scale_factor=2.0, loss_scale_patience=10,
        loss_scale_max=2.0 ** 24,  # ceiling of the scale (NVIDIA Apex amp's max_loss_scale); finite
    ))

    c.optim = ml_collections.ConfigDict(dict(
        lr=3e-4, min_lr_ratio=0.1, warmup_steps=100, decay_steps=1000,
        weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, clip_norm=1.0,
        zero_stage=0,
    ))

    c.pipeline = ml_collections.ConfigDict(dict(
        schedule="gpipe",  # a name in jaxpar.pipeline.SCHEDULES: gpipe, circular (GPipe family), 1f1b, zb_h1
        virtual_stages=1,  # chunks per stage with the circular or 1f1b (interleaved) schedule
        remat=True,  # recompute each stage's layers in the backward pass (1f1b with False: keep vjp residuals)
        skip_bubbles=True,  # skip the compute of bubble slots (False: compute and discard; for measurements)
    ))

    c.data = ml_collections.ConfigDict(dict(
        # one source or a blend "0.3 A 0.7 B" (Megatron's --data-path); a source is shakespeare, text:GLOB,
        # jsonl:GLOB, parquet:GLOB, megatron:PREFIX or tokens:DIR (the kind is guessed from a bare path)
        sources="shakespeare",
        text_field="text",  # the JSONL field / Parquet column holding a document's text
        doc_separator="",  # text files: "" = one document per file; e.g. "\\n\\n" = split at blank lines
        tokenizer="byte",  # byte | bpe | path to a tokenizer.json
        bpe_vocab_size=4096,  # with tokenizer=bpe: trained on the first bpe_sample_mb MB of the text sources
        bpe_sample_mb=64,
        val_fraction=0.05,  # the last fraction of each source's documents is its validation split
        val_split="documents",  # documents | tokens (the last val_fraction of the tokens: runs from before)
        packing="concat",  # concat: windows over the documents back to back | documents: attention within each
        workers=1,  # tokenizer processes (1: in this process, on tokenizers' own threads)
        unit_mb=64,  # a worker's share of one big file (MB)
        prefetch=4,  # batches read ahead in a background thread
        cache_dir="",  # "": $JAXPAR_CACHE or ~/.cache/jaxpar
    ))

    # before the first compile (jaxpar/runtime.py): JAX's persistent compilation cache ("" dir: <cache>/xla), and
    # XLA's GPU flags ("default": jaxpar's set, runtime.GPU_FLAGS; "": none; or your own flags), GPU only
    c.xla = ml_collections.ConfigDict(dict(compile_cache=True, compile_cache_dir="", gpu_flags="default"))
    c.checkpoint = ml_collections.ConfigDict(dict(every_steps=200, keep=3, async_save=True))
    c.log = ml_collections.ConfigDict(dict(every_steps=10, profile_steps=(), progress=True))
    c.eval = ml_collections.ConfigDict(dict(every_steps=100, batches=8))
    # multi-process: a process silent for heartbeat_timeout_s makes the others exit with a message. No step boundary
    # within the step bound stops every process, naming the step: step_timeout_s seconds, or -1 (auto) max(
    # step_timeout_min_s, step_timeout_factor x the slowest step so far), evaluation and saves included; 0 = off.
    # The first, compiling step is not timed.
    c.dist = ml_collections.ConfigDict(dict(heartbeat_timeout_s=60.0, step_timeout_s=-1.0, step_timeout_min_s=60.0,
                                            step_timeout_factor=20.0, init_timeout_s=300.0))
    return c


def mlp_width(config) -> int:
    return config.model.mlp or 4 * config.model.embed


def padded_vocab(vocab_size: int, tensor: int) -> int:
    """Smallest multiple of lcm(128, tensor) >= vocab_size (Megatron's `make-vocab-size-divisible-by`)."""
    m = 128 * tensor // math.gcd(128, tensor)
    return -(-vocab_size // m) * m


def mesh_shape(config, num_devices: int) -> dict[str, int]:
    """Resolve `data = -1` into the devices left over; returns {'data', 'tensor', 'stage'} sizes."""
    t, s, d = int(config.mesh.tensor), int(config.mesh.stage), int(config.mesh.data)
    for name, v in (("tensor", t), ("stage", s)):
        if v < 1:
            raise ConfigError(f"mesh.{name}={v}: must be >= 1.")
    if d == -1:
        if num_devices % (t * s):
            raise ConfigError(
                f"mesh.tensor={t} x mesh.stage={s} = {t * s} does not divide the {num_devices} devices; "
                f"pick tensor x stage among the divisors of {num_devices}.")
        d = num_devices // (t * s)
    if d < 1 or d * t * s != num_devices:
        raise ConfigError(
            f"layout data={d} x tensor={t} x stage={s} = {d * t * s} devices, but {num_devices} are present; "
            f"set --config.mesh.data=-1 to use the rest, or make the product {num_devices}.")
    return {"data": d, "tensor": t, "stage": s}


def nearest_multiples(value: int, m: int) -> str:
    """The multiples of `m` nearest `value` on either side: "4 or 8" for (6, 4); "8" for (2, 8) (0 is no size)."""
    lo, hi = value // m * m, -(-value // m) * m
    return " or ".join(str(x) for x in dict.fromkeys((lo, hi)) if x > 0)


def _get(config, key: str):
    for part in key.split("."):
        config = config[part]
    return config


def step_rules(config) -> tuple:
    """`config.rules` with model.sequence_parallel applied (`act_seq` -> `tensor`)."""
    rules = tuple(tuple(r) for r in config.rules)
    if not config.model.sequence_parallel:
        return rules
    return tuple((n, "tensor") if n == "act_seq" else (n, a) for n, a in rules)


RENAMED = {"data.corpus": "data.sources"}  # keys of older jaxpar versions: their names now


def flat_keys(config, prefix: str = "") -> list[str]:
    """The dotted keys of a config (`rules` is one key)."""
    out = []
    for k, v in config.items():
        if isinstance(v, ml_collections.ConfigDict) and k != "rules":
            out += flat_keys(v, prefix + k + ".")
        else:
            out.append(prefix + k)
    return out


def unknown_keys(keys) -> list[str]:
    """One message per key of `keys` that `base_config()` does not have, naming its new name or the nearest key."""
    known = set(flat_keys(base_config()))
    errs = []
    for k in keys:
        if k in known or k.split(".")[0] == "rules":
            continue
        near = RENAMED.get(k) or _nearest(k, sorted(known))
        hint = f"; it is now {near}" if k in RENAMED else (f"; did you mean {near}?" if near else "")
        errs.append(f"{k}: no such config key{hint} (every key: docs/config.md).")
    return errs


def _nearest(key: str, known: list[str]) -> str | None:
    """The known key `key` most likely meant: one it begins (optim.zero -> optim.zero_stage), else the closest
    spelling in its own section, else anywhere."""
    longer = [k for k in known if k.startswith(key)]
    if longer:
        return min(longer, key=len)
    section = [k for k in known if k.rsplit(".", 1)[0] == key.rsplit(".", 1)[0]]
    return next(iter(difflib.get_close_matches(key, section, 1, 0.6) or difflib.get_close_matches(key, known, 1, 0.6)),
                None)


def check_command_line(argv) -> None:
    """`--config.KEY=VALUE` arguments naming no key: one line each, before ml_collections meets them (its error is a
    traceback). Raises ConfigError."""
    keys = [m.group(1) for a in argv if (m := re.match(r"--config\.([^=\s]+)", a))]
    errs = unknown_keys(keys)
    if errs:
        raise ConfigError(" ".join(f"--config.{e}" for e in errs))


