"""`validate(config, num_devices)`: every rule on every key, in one place, before anything is compiled or written:
ranges and types, the model's shape against the layout, the kernels, loss scaling, float64 reference runs and the
pipeline schedule. Each failure is one line naming the key, the numbers and the fix (`ConfigError`). Imports the
owners of the rules; only entry points (trainer, planner, report, tools) import it.
"""
from __future__ import annotations

import numbers

import jax

from jaxpar import loss_scale
from jaxpar.attention import IMPLEMENTATIONS, choose
from jaxpar.config import (DEFAULT_RULES, DTYPES, MESH_AXES, REMAT_POLICIES, ConfigError, _get, base_config,
                           mesh_shape, mlp_width, nearest_multiples, unknown_keys, flat_keys)
from jaxpar.cross_entropy import chunk_size
from jaxpar.model import ARCHS, ROPE_SCALINGS
from jaxpar.pipeline.registry import errors as schedule_errors


def _check_loss_scale(config) -> list[str]:
    try:
        loss_scale.from_config(config)
    except ValueError as e:
        return [f"{e} (the train.loss_scale_* keys)"]
    if int(config.train.loss_scale_patience) < 1:
        return [f"train.loss_scale_patience={config.train.loss_scale_patience} must be >= 1."]
    return []


def _check_float64(tr) -> list[str]:
    """float64 is for reference runs (the tests' exact-arithmetic stand-in): both dtypes and JAX's x64 mode. Every
    layout runs it (loss sums and gradient buffers are at least the compute dtype: `dtypes.at_least_f32`)."""
    wide = [k for k in ("param_dtype", "compute_dtype") if tr[k] == "float64"]
    if not wide:
        return []
    errs = []
    if len(wide) == 1:
        errs.append(f"train.{wide[0]}='float64' needs the other dtype float64 too (a float64 reference run).")
    if not jax.config.jax_enable_x64:
        errs.append("float64 needs JAX's 64-bit mode: set JAX_ENABLE_X64=1 (or run inside `jax.enable_x64(True)`).")
    return errs


# (key, integer?, allowed values, test) for `_check_ranges`; a test sees a real number (an int for integer keys)
_INF = float("inf")
_RANGES = (
    ("model.vocab_size", True, "an integer >= 0 (0: taken from the tokenizer)", lambda v: v >= 0),
    ("model.embed", True, "an integer >= 1", lambda v: v >= 1),
    ("model.heads", True, "an integer >= 1", lambda v: v >= 1),
    ("model.mlp", True, "an integer >= 0 (0: 4 x model.embed)", lambda v: v >= 0),
    ("model.kv_heads", True, "an integer >= 0 (0: = model.heads)", lambda v: v >= 0),
    ("model.max_positions", True, "an integer >= 0 (0: = model.seq_len)", lambda v: v >= 0),
    ("model.norm_eps", False, "a number > 0", lambda v: 0 < v < _INF),
    ("model.rope_theta", False, "a number > 0", lambda v: 0 < v < _INF),
    ("model.rope_factor", False, "a number >= 1", lambda v: 1 <= v < _INF),
    ("model.rope_low_freq_factor", False, "a number > 0", lambda v: 0 < v < _INF),
    ("model.rope_high_freq_factor", False, "a number > model.rope_low_freq_factor", lambda v: 0 < v < _INF),
    ("model.rope_original_max_len", True, "an integer >= 1", lambda v: v >= 1),
    ("model.dropout_embed", False, "a number in [0, 1)", lambda v: 0 <= v < 1),
    ("model.dropout_resid", False, "a number in [0, 1)", lambda v: 0 <= v < 1),
    ("train.global_batch_size", True, "an integer >= 1", lambda v: v >= 1),
    ("train.seed", True, "an integer >= 0", lambda v: v >= 0),
    ("optim.lr", False, "a finite number >= 0 (0: the params stay put)", lambda v: 0 <= v < _INF),
    ("optim.min_lr_ratio", False, "a number in [0, 1] (the final LR is lr x min_lr_ratio)", lambda v: 0 <= v <= 1),
    ("optim.weight_decay", False, "a finite number >= 0", lambda v: 0 <= v < _INF),
    ("optim.b1", False, "a number in [0, 1)", lambda v: 0 <= v < 1),
    ("optim.b2", False, "a number in [0, 1)", lambda v: 0 <= v < 1),
    ("optim.eps", False, "a finite number > 0", lambda v: 0 < v < _INF),
    ("optim.clip_norm", False, "a number > 0 (the global-norm clip; inf: no clipping)", lambda v: v > 0),
    ("pipeline.virtual_stages", True, "an integer >= 1", lambda v: v >= 1),
    ("data.val_fraction", False, "a number in (0, 1) (that last fraction of the documents is the validation split)",
     lambda v: 0 < v < 1),
    ("data.bpe_vocab_size", True, "an integer > 257 (256 bytes and the end-of-text token)", lambda v: v > 257),
    ("data.bpe_sample_mb", True, "an integer >= 1 (MB of text the BPE tokenizer trains on)", lambda v: v >= 1),
    ("data.workers", True, "an integer >= 1 (tokenizer processes)", lambda v: v >= 1),
    ("data.unit_mb", True, "an integer >= 1 (MB of one file per worker task)", lambda v: v >= 1),
    ("data.prefetch", True, "an integer >= 0 (batches read ahead; 0: none)", lambda v: v >= 0),
    ("eval.batches", True, "an integer >= 1", lambda v: v >= 1),
)
_BOOLS = ("model.tie_embeddings", "train.allow_batch_change", "pipeline.remat", "pipeline.skip_bubbles",
          "checkpoint.async_save", "log.progress", "model.sequence_parallel", "xla.compile_cache")


def _default(key: str):
    """base_config()'s value of a dotted key (for messages: built only when there is one to write)."""
    return _get(base_config(), key)


def _check_ranges(config) -> list[str]:
    """The numeric and boolean keys `validate` checks nowhere else (table `_RANGES`, `_BOOLS`), then `_check_kinds`."""
    errs = []
    for key, integer, allowed, test in _RANGES:
        v = _get(config, key)
        kind = numbers.Integral if integer else numbers.Real
        if isinstance(v, bool) or not isinstance(v, kind) or not test(v):
            errs.append(f"{key}={v!r} must be {allowed}; set --config.{key} to such a value (default "
                        f"{_default(key)!r}).")
    for key in _BOOLS:
        v = _get(config, key)
        if not isinstance(v, bool):
            errs.append(f"{key}={v!r} must be True or False; set --config.{key}=True or --config.{key}=False.")
    return errs + _check_kinds(config)


def _check_kinds(config) -> list[str]:
    """Strings, the profile window and the rules table: the keys that are neither a number nor a bool."""
    errs = []
    for key in ("name", "init_from", "data.cache_dir", "model.arch", "model.rope_scaling", "data.doc_separator"):
        v = _get(config, key)
        if not isinstance(v, str):
            errs.append(f"{key}={v!r} must be a string; set --config.{key}='...' (default {_default(key)!r}).")
    for key, allowed in (("data.sources", "a source ('shakespeare', 'data/*.jsonl', ...) or a blend '0.3 A 0.7 B'"),
                         ("data.tokenizer", "'byte', 'bpe' or a path to a tokenizer.json"),
                         ("data.text_field", "the JSONL field / Parquet column holding the text")):
        v = _get(config, key)
        if not isinstance(v, str) or not v.strip():
            errs.append(f"{key}={v!r} must be {allowed}; set --config.{key} to one (default {_default(key)!r}).")
    for key, allowed in (("data.packing", ("concat", "documents")), ("data.val_split", ("documents", "tokens"))):
        if _get(config, key) not in allowed:
            errs.append(f"{key}={_get(config, key)!r}: pick one of {allowed}.")
    steps = config.log.profile_steps
    if not isinstance(steps, (tuple, list)) or not all(
            isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 0 for s in steps):
        errs.append(f"log.profile_steps={steps!r} must be a tuple of step numbers >= 0 (the trace covers min to max; "
                    f"() is off); e.g. --config.log.profile_steps='(10, 12)'.")
    axis = lambda a: a is None or a in MESH_AXES or (
        isinstance(a, (tuple, list)) and all(isinstance(x, str) and x in MESH_AXES for x in a))
    rules = config.rules
    bad = [r for r in rules if not (isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str)
                                    and axis(r[1]))] if isinstance(rules, (tuple, list)) else [rules]
    if bad:
        errs.append(f"rules: {bad[0]!r} is not a (logical axis, mesh axis) pair; the mesh axis must be None, one of "
                    f"{MESH_AXES} or a tuple of them (see DEFAULT_RULES).")
    missing = [n for n, _ in DEFAULT_RULES if not bad and n not in dict(rules)]
    if missing:
        errs.append(f"rules has no entry for the logical axes {missing}; add (name, mesh axis or None) pairs for them "
                    f"(see DEFAULT_RULES).")
    return errs


def check_model(m, t: int, mlp: int) -> list[str]:
    """The model's shape against itself and the tensor size `t` (MLP width `mlp`); both families."""
    errs = []
    if m.arch not in ARCHS:
        errs.append(f"model.arch={m.arch!r}: pick one of {ARCHS}.")
    if m.heads >= 1 and m.embed % m.heads:
        errs.append(f"model.embed={m.embed} is not divisible by model.heads={m.heads}; pick heads dividing "
                    f"{m.embed} (head size = embed / heads).")
    if m.heads % t:
        errs.append(f"model.heads={m.heads} is not divisible by mesh.tensor={t}; use heads a multiple of {t} "
                    f"(the nearest: {nearest_multiples(m.heads, t)}) or a tensor size dividing {m.heads}.")
    if mlp % t:
        errs.append(f"MLP width {mlp} is not divisible by mesh.tensor={t}; set model.mlp to a "
                    f"multiple of {t} (the nearest: {nearest_multiples(mlp, t)}).")
    if m.max_positions and m.seq_len > m.max_positions:
        errs.append(f"model.seq_len={m.seq_len} > model.max_positions={m.max_positions}: the model has no positions "
                    f"past {m.max_positions}; train with --config.model.seq_len={m.max_positions} or less.")
    if m.arch != "llama":
        return errs
    kv = m.kv_heads or m.heads
    if kv >= 1 and m.heads % kv:
        errs.append(f"model.kv_heads={kv} does not divide model.heads={m.heads}: each KV head serves a whole group "
                    f"of query heads; pick kv_heads among the divisors of {m.heads}.")
    elif kv >= 1 and kv % t and t % kv:
        errs.append(f"model.kv_heads={kv} and mesh.tensor={t}: the KV heads split over tensor when kv_heads is a "
                    f"multiple of it, and are replicated when tensor is a multiple of kv_heads; neither holds. Use a "
                    f"tensor size dividing {kv} or a multiple of it.")
    if m.heads >= 1 and (m.embed // m.heads) % 2:
        errs.append(f"model.embed / model.heads = {m.embed // m.heads}: RoPE needs an even head size.")
    if m.rope_scaling not in ROPE_SCALINGS:
        errs.append(f"model.rope_scaling={m.rope_scaling!r}: pick one of {ROPE_SCALINGS}.")
    if m.rope_high_freq_factor <= m.rope_low_freq_factor:
        errs.append(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed model.rope_low_freq_factor="
                    f"{m.rope_low_freq_factor} (Llama 3.1: 4 and 1).")
    return errs


def _check_kernels(config, t: int) -> list[str]:
    """model.attention (against the dtype, the packing and this process's backend), model.loss_chunk,
    model.sequence_parallel."""
    m, errs = config.model, []
    if m.attention not in IMPLEMENTATIONS:
        errs.append(f"model.attention={m.attention!r}: pick one of {IMPLEMENTATIONS}.")
    elif m.attention not in ("auto", "xla") and m.heads >= 1 and config.train.compute_dtype in DTYPES:
        backend = "gpu" if m.attention == "pallas" else jax.default_backend()  # pallas: interpret mode off GPU
        try:
            choose(m.attention, config.train.compute_dtype, m.seq_len, m.embed // m.heads,
                   config.data.packing == "documents", backend=backend)
        except ValueError as e:
            errs.append(str(e) + ".")
    if m.loss_chunk < 1:
        errs.append(f"model.loss_chunk={m.loss_chunk} must be >= 1 (sequence positions per chunk of the loss).")
    elif m.seq_len > m.loss_chunk >= 4:
        c = chunk_size(m.seq_len, m.loss_chunk)
        if 4 * c < m.loss_chunk:
            errs.append(f"model.loss_chunk={m.loss_chunk}: the loss runs in chunks dividing seq_len={m.seq_len}, "
                        f"and the largest is {c} ({m.seq_len // c} chunks); pick a loss_chunk dividing {m.seq_len}.")
    if m.sequence_parallel and m.seq_len % t:
        errs.append(f"model.sequence_parallel with model.seq_len={m.seq_len} not divisible by mesh.tensor={t}: "
                    f"the sequence is split over tensor; use a seq_len multiple of {t}.")
    return errs


def validate(config, num_devices: int) -> dict[str, int]:
    """Check every rule before anything compiles. Returns the resolved mesh shape.

    Raises:
      ConfigError: naming the offending numbers and the fix.
    """
    unknown = unknown_keys(flat_keys(config))
    if unknown:
        raise ConfigError("invalid config:\n  " + "\n  ".join(unknown))
    shape = mesh_shape(config, num_devices)
    d, t, s = shape["data"], shape["tensor"], shape["stage"]
    m, tr, o = config.model, config.train, config.optim
    B, M = int(tr.global_batch_size), int(tr.microbatches)
    errs = []
    if M < 1:
        errs.append(f"train.microbatches={M} must be >= 1.")
    elif B % (d * M):
        errs.append(
            f"train.global_batch_size={B} is not divisible by mesh.data={d} x train.microbatches={M} = {d * M}; "
            f"use a batch that is a multiple of {d * M} (the nearest: {nearest_multiples(B, d * M)}) or change the "
            f"layout.")
    errs += check_model(m, t, mlp_width(config))
    v = max(1, int(config.pipeline.virtual_stages))
    if m.layers % (s * v):
        errs.append(f"model.layers={m.layers} is not divisible by mesh.stage={s} x pipeline.virtual_stages={v}; "
                    f"use a multiple of {s * v} layers (the nearest: {nearest_multiples(m.layers, s * v)}) or fewer "
                    f"stages / virtual stages.")
    if s > 1 and M < s:
        errs.append(f"train.microbatches={M} < mesh.stage={s}: the pipeline needs at least one microbatch per "
                    f"stage; set --config.train.microbatches={s} or more.")
    errs += schedule_errors(config.pipeline.schedule, s, M, v, bool(config.pipeline.remat))
    if m.remat not in REMAT_POLICIES:
        errs.append(f"model.remat={m.remat!r}: pick one of {REMAT_POLICIES}.")
    errs += _check_kernels(config, t)
    for k in ("param_dtype", "compute_dtype"):
        if tr[k] not in DTYPES:
            errs.append(f"train.{k}={tr[k]!r}: pick one of {DTYPES}.")
    errs += _check_float64(tr)
    errs += _check_loss_scale(config)
    if tr.nonfinite not in ("stop", "skip"):
        errs.append(f"train.nonfinite={tr.nonfinite!r}: pick 'stop' or 'skip'.")
    if o.zero_stage not in (0, 1, 2, 3):
        errs.append(f"optim.zero_stage={o.zero_stage}: pick 0, 1, 2 or 3.")
    if o.warmup_steps < 0 or o.decay_steps < o.warmup_steps:
        errs.append(f"optim.warmup_steps={o.warmup_steps}, optim.decay_steps={o.decay_steps}: need "
                    f"0 <= warmup_steps <= decay_steps.")
    for name, val in (("model.seq_len", m.seq_len), ("model.layers", m.layers), ("train.steps", tr.steps),
                      ("log.every_steps", config.log.every_steps), ("eval.every_steps", config.eval.every_steps),
                      ("checkpoint.every_steps", config.checkpoint.every_steps)):
        if val < 1:
            errs.append(f"{name}={val} must be >= 1.")
    if int(config.checkpoint.keep) < 1:
        errs.append(f"checkpoint.keep={config.checkpoint.keep} must be >= 1 (the newest checkpoint is always kept).")
    dist = config.dist
    if dist.heartbeat_timeout_s <= 0 or dist.init_timeout_s <= 0:
        errs.append(f"dist.heartbeat_timeout_s={dist.heartbeat_timeout_s}, dist.init_timeout_s={dist.init_timeout_s} "
                    f"must be > 0.")
    if not (dist.step_timeout_s >= 0 or dist.step_timeout_s == -1) or dist.step_timeout_min_s <= 0 \
            or dist.step_timeout_factor < 1:
        errs.append(f"dist.step_timeout_s={dist.step_timeout_s} must be -1 (auto), 0 (off) or seconds > 0; "
                    f"dist.step_timeout_min_s={dist.step_timeout_min_s} > 0 and dist.step_timeout_factor="
                    f"{dist.step_timeout_factor} >= 1.")
    errs += _check_ranges(config)
    flags = str(config.xla.gpu_flags)
    if flags != "default" and any(not f.startswith("--xla_") for f in flags.split()):
        errs.append(f"xla.gpu_flags={flags!r}: use 'default', '' (none) or XLA flags like "
                    f"'--xla_gpu_enable_latency_hiding_scheduler=true'.")
    if errs:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errs))
    return shape
