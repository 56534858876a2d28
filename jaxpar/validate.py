"""`validate(config, num_devices)`: every rule on every key, in one place, before anything is compiled or written:
each key's type and range (from the key table, `jaxpar/config_keys/`), the model's shape against the layout, the
kernels, loss scaling, float64 reference runs and the pipeline schedule. Each failure is one line naming the key, the numbers and the fix (`ConfigError`). Imports the
owners of the rules; only entry points (trainer, planner, report, tools) import it.
"""
from __future__ import annotations

import importlib.util
import numbers

import jax

from jaxpar.train import loss_scale, objectives
from jaxpar.kernels.attention import IMPLEMENTATIONS, choose
from jaxpar.config import (DEFAULT_RULES, DTYPES, MESH_AXES, ConfigError, flat_keys, mlp_width, nearest_multiples,
                           unknown_keys)
from jaxpar.config_keys import key_errors
from jaxpar.kernels import grouped
from jaxpar.kernels.cross_entropy import chunk_size
from jaxpar.layout import Layout
from jaxpar.model import ARCHS, FAMILIES, ROPE_SCALINGS, block_weights, config_from, lora, moe
from jaxpar.parallel.pipeline.registry import errors as schedule_errors


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


def _check_lora(config) -> list[str]:
    """LoRA's keys against each other and the model: targets it has, dropout where it can be keyed."""
    lo = config.lora
    if lo.rank == 0:
        given = [k for k, off in (("targets", "auto"), ("adapter", ""), ("base_dtype", "")) if lo[k] != off]
        return [f"lora.{given[0]}={lo[given[0]]!r} with lora.rank=0 (no adapters): set --config.lora.rank (e.g. 16) "
                f"to train LoRA adapters, or drop lora.{given[0]}."] if given else []
    family = FAMILIES.get(config.model.arch)
    if family is None or not family.lora_names:  # (a family without LoRA refuses it with its own line)
        return []
    try:
        weights = block_weights(config_from(config, 1, 1))
    except Exception:  # noqa: BLE001 (a model shape the rules below refuse with their own message)
        return []
    errs = []
    missing = lora.missing(family, lo.targets, weights)
    if missing:
        errs.append(f"lora.targets={lo.targets!r}: {', '.join(missing)} names no weight of this "
                    f"{config.model.arch} model; its names: {lora.known_names(family)}.")
    adapted = set(lora.candidates(family, lo.targets)) & weights
    if lo.dropout > 0 and any(p.startswith(lora.NOT_SUPPORTED_WITH_DROPOUT) for p in adapted):
        errs.append(f"lora.dropout={lo.dropout} with adapters on the routed experts (lora.targets={lo.targets!r}): "
                    f"their inputs are dispatched buffers, whose dropout jaxpar cannot key by sequence; set "
                    f"lora.dropout=0 or leave the experts' projections out of lora.targets.")
    return errs


def _step_list(steps, least: int) -> bool:
    return isinstance(steps, (tuple, list)) and all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= least for s in steps)


def _check_trackers(config) -> list[str]:
    """`log.wandb_project` needs the `wandb` package (an optional extra), found before anything compiles."""
    if config.log.wandb_project and importlib.util.find_spec("wandb") is None:
        return [f"log.wandb_project={config.log.wandb_project!r} needs the wandb package, which is not installed: "
                f"pip install 'jaxpar[wandb]' (or drop log.wandb_project)."]
    return []


def _check_kinds(config) -> list[str]:
    """The keys the key table leaves to validate: the profile window and the rules table."""
    errs = []
    steps = config.log.profile_steps
    if not _step_list(steps, 0):
        errs.append(f"log.profile_steps={steps!r} must be a tuple of step numbers >= 0 (the trace covers min to max; "
                    f"() is off); e.g. --config.log.profile_steps='(10, 12)'.")
    skip = config.train.skip_steps
    if not _step_list(skip, 1):
        errs.append(f"train.skip_steps={skip!r} must be a tuple of step numbers >= 1 (as the log counts them; () is "
                    f"none); e.g. --config.train.skip_steps='(1200, 1201)'.")
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
    if m.heads >= 1 and m.embed % m.heads and not m.head_dim:
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
    family = FAMILIES.get(m.arch)
    if family is None or not family.grouped_query:  # (the rules below are grouped-query attention's and RoPE's)
        qk = m.qk_norm and not (family and family.qk_norm)
        return errs + ([f"model.qk_norm=True with model.arch={m.arch!r}: the q/k norms are llama-family (Qwen3); "
                        f"use model.arch='llama'."] if qk else [])
    kv = m.kv_heads or m.heads
    if kv >= 1 and m.heads % kv:
        errs.append(f"model.kv_heads={kv} does not divide model.heads={m.heads}: each KV head serves a whole group "
                    f"of query heads; pick kv_heads among the divisors of {m.heads}.")
    elif kv >= 1 and kv % t and t % kv:
        errs.append(f"model.kv_heads={kv} and mesh.tensor={t}: the KV heads split over tensor when kv_heads is a "
                    f"multiple of it, and are replicated when tensor is a multiple of kv_heads; neither holds. Use a "
                    f"tensor size dividing {kv} or a multiple of it.")
    hd = m.head_dim or (m.embed // m.heads if m.heads >= 1 else 2)
    if hd % 2:
        errs.append(f"head size {hd} (model.head_dim, or model.embed / model.heads): RoPE needs an even head size.")
    if m.rope_scaling not in ROPE_SCALINGS:
        errs.append(f"model.rope_scaling={m.rope_scaling!r}: pick one of {ROPE_SCALINGS}.")
    if m.rope_high_freq_factor <= m.rope_low_freq_factor:
        errs.append(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed model.rope_low_freq_factor="
                    f"{m.rope_low_freq_factor} (Llama 3.1: 4 and 1).")
    return errs


def expert_width(m) -> int:
    """A routed expert's SwiGLU width: `model.expert_mlp`, else the dense MLP's."""
    return m.expert_mlp or m.mlp or 4 * m.embed


def check_experts(m, lay: Layout) -> list[str]:
    """The mixture-of-experts keys against the model and the layout."""
    E, k, e, t = m.experts, m.experts_per_token, lay.expert, lay.tensor
    if E == 0:
        return [] if e == 1 else [f"mesh.expert={e} but model.experts=0 (a dense model has no experts to split); set "
                                  f"--config.model.experts to a multiple of {e}, or mesh.expert=1."]
    errs = []
    if m.expert_buffer_factor and (m.moe_impl == "buffers" or e == 1):
        why = "model.moe_impl='buffers' sends fixed buffers" if m.moe_impl == "buffers" else \
            "mesh.expert=1 sends no rows"
        errs.append(f"model.expert_buffer_factor={m.expert_buffer_factor} bounds the rows `ragged` sends to each "
                    f"expert device, but {why}; drop it, or use model.moe_impl='ragged' with mesh.expert > 1.")
    if k > E:
        errs.append(f"model.experts_per_token={k} > model.experts={E}: a token picks k different experts; use k <= "
                    f"{E}.")
    if E % e:
        errs.append(f"model.experts={E} is not divisible by mesh.expert={e}: each expert device holds experts / "
                    f"expert of them; use mesh.expert dividing {E} or experts a multiple of {e} (the nearest: "
                    f"{nearest_multiples(E, e)}).")
    width = expert_width(m)
    if width % t:
        errs.append(f"model.expert_mlp={width} is not divisible by mesh.tensor={t}; use a multiple of {t}.")
    if m.first_dense_layers >= m.layers:
        errs.append(f"model.first_dense_layers={m.first_dense_layers} leaves no MoE layer of model.layers="
                    f"{m.layers}; use fewer dense layers, or model.experts=0 for a dense model.")
    return errs


def check_grouped(m, compute_dtype: str) -> list[str]:
    """`model.grouped_matmul='mosaic'` where its kernel cannot run the routed experts' matmuls, or nothing reads it."""
    if m.grouped_matmul != "mosaic" or m.experts == 0:
        return []
    if m.moe_impl == "buffers":  # `auto` is checked again once resolved (`plan.target.resolve`)
        return ["model.grouped_matmul='mosaic' runs `ragged`'s grouped matmuls, but model.moe_impl='buffers' runs "
                "none; set model.moe_impl='ragged', or drop model.grouped_matmul."]
    if jax.default_backend() == "gpu" and not grouped.hopper():
        dev = jax.devices()[0]
        return [f"model.grouped_matmul='mosaic' runs JAX's Hopper kernel (compute capability 9.x), but this GPU is "
                f"{dev.device_kind} ({getattr(dev, 'compute_capability', '?')}); use 'auto' or 'xla'."]
    width = expert_width(m)
    why = grouped.mosaic_reason(compute_dtype, m.embed, width)
    return [] if why is None else [f"model.grouped_matmul='mosaic' cannot run the experts' [{m.embed}, {width}] "
                                   f"matmuls in train.compute_dtype={compute_dtype}: {why}; use 'auto' or 'xla'."]


def check_context(m, c: int, t: int) -> list[str]:
    """Context parallelism's rules (`mesh.context` = c > 1) against the model and `mesh.tensor` = t."""
    if c == 1:
        return []
    errs = []
    if m.sequence_parallel and m.seq_len % (2 * c) == 0 and (m.seq_len // c) % t:
        errs.append(f"model.sequence_parallel splits each context device's {m.seq_len // c} tokens over "
                    f"mesh.tensor={t}; use a seq_len that is a multiple of {c * t}.")
    if m.seq_len % (2 * c):
        errs.append(f"model.seq_len={m.seq_len} is not divisible by 2 x mesh.context={c} = {2 * c}: each context "
                    f"device holds two equal chunks of every sequence; use a multiple of {2 * c} (the nearest: "
                    f"{nearest_multiples(m.seq_len, 2 * c)}).")
    if m.attention in ("cudnn", "pallas"):
        errs.append(f"model.attention={m.attention!r} cannot serve mesh.context={c}: its kernel attends within the "
                    f"sequence it is given, and a context device holds pieces; use 'auto' or 'xla' (the blockwise "
                    f"kernel runs there, docs/context.md).")
    if m.dropout_embed > 0 or m.dropout_resid > 0:
        errs.append(f"dropout (model.dropout_embed={m.dropout_embed}, model.dropout_resid={m.dropout_resid}) with "
                    f"mesh.context={c}: the masks are drawn per whole sequence; set both to 0 or mesh.context=1.")
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
            choose(m.attention, config.train.compute_dtype, m.seq_len, m.head_dim or m.embed // m.heads,
                   config.data.packing != "concat", backend=backend)
        except ValueError as e:
            errs.append(str(e) + ".")
    if m.seq_len > m.loss_chunk >= 4:
        c = chunk_size(m.seq_len, m.loss_chunk)
        if 4 * c < m.loss_chunk:
            errs.append(f"model.loss_chunk={m.loss_chunk}: the loss runs in chunks dividing seq_len={m.seq_len}, "
                        f"and the largest is {c} ({m.seq_len // c} chunks); pick a loss_chunk dividing {m.seq_len}.")
    if m.sequence_parallel and m.seq_len % t:
        errs.append(f"model.sequence_parallel with model.seq_len={m.seq_len} not divisible by mesh.tensor={t}: "
                    f"the sequence is split over tensor; use a seq_len multiple of {t}.")
    return errs


def validate(config, num_devices: int) -> Layout:
    """Check every rule before anything compiles. Returns the config's layout on `num_devices` devices.

    Raises:
      ConfigError: naming the offending numbers and the fix.
    """
    unknown = unknown_keys(flat_keys(config))
    if unknown:
        raise ConfigError("invalid config:\n  " + "\n  ".join(unknown))
    lay = Layout.from_config(config, num_devices)
    d, t, s = lay.data, lay.tensor, lay.stage
    m, tr, o = config.model, config.train, config.optim
    B, M = int(tr.global_batch_size), int(tr.microbatches)
    errs = key_errors(config) + _check_kinds(config)  # each key's type and range (the key table), then the rest
    n = lay.batch_split * M
    rows = objectives.from_config(config).rows(config) if not errs and tr.objective in objectives.OBJECTIVES else B
    if M >= 1 and rows % n:
        split = f"mesh.data={d}" + (f" x mesh.expert={lay.expert}" if lay.expert > 1 else "")
        what = f"train.global_batch_size={B}" if rows == B else \
            f"a step's {rows} rows (train.global_batch_size={B} x {rows // B} each: grpo.num_generations)"
        errs.append(
            f"{what} is not divisible by {split} x train.microbatches={M} = {n}; use a batch that is a multiple of "
            f"{n} (the nearest: {nearest_multiples(rows, n)}) or change the layout.")
    errs += check_model(m, t, mlp_width(config)) + check_experts(m, lay) + check_grouped(m, tr.compute_dtype)
    family = FAMILIES.get(m.arch)
    errs += check_context(m, lay.context, t) if family is None or family.context_parallel else []
    v = max(1, int(config.pipeline.virtual_stages))
    if m.layers % (s * v):
        errs.append(f"model.layers={m.layers} is not divisible by mesh.stage={s} x pipeline.virtual_stages={v}; "
                    f"use a multiple of {s * v} layers (the nearest: {nearest_multiples(m.layers, s * v)}) or fewer "
                    f"stages / virtual stages.")
    if s > 1 and M < s:
        errs.append(f"train.microbatches={M} < mesh.stage={s}: the pipeline needs at least one microbatch per "
                    f"stage; set --config.train.microbatches={s} or more.")
    errs += schedule_errors(config.pipeline.schedule, s, M, v, bool(config.pipeline.remat))
    if s > 1 and not config.pipeline.remat and m.remat == "offload":
        errs.append("model.remat='offload' with pipeline.remat=False: the 1F1B loop keeps each stage's residuals in "
                    "its own device buffers (the CUDA lowering refuses host ones there); use model.remat='selective' "
                    "or pipeline.remat=True.")
    errs += _check_kernels(config, t)
    errs += _check_float64(tr)
    errs += _check_loss_scale(config)
    errs += _check_lora(config) + objectives.errors(config, lay) + _check_trackers(config)
    errs += family.errors(config, lay) if family else []  # the family's own rules (a ViT's)
    if o.warmup_steps < 0 or o.decay_steps < o.warmup_steps:
        errs.append(f"optim.warmup_steps={o.warmup_steps}, optim.decay_steps={o.decay_steps}: need "
                    f"0 <= warmup_steps <= decay_steps.")
    dist = config.dist
    if not (dist.step_timeout_s >= 0 or dist.step_timeout_s == -1) or dist.step_timeout_min_s <= 0 \
            or dist.step_timeout_factor < 1:
        errs.append(f"dist.step_timeout_s={dist.step_timeout_s} must be -1 (auto), 0 (off) or seconds > 0; "
                    f"dist.step_timeout_min_s={dist.step_timeout_min_s} > 0 and dist.step_timeout_factor="
                    f"{dist.step_timeout_factor} >= 1.")
    flags = str(config.xla.gpu_flags)
    if flags != "default" and any(not f.startswith("--xla_") for f in flags.split()):
        errs.append(f"xla.gpu_flags={flags!r}: use 'default', '' (none) or XLA flags like "
                    f"'--xla_gpu_enable_latency_hiding_scheduler=true'.")
    if errs:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errs))
    return lay
