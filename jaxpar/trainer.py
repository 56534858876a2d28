"""The training loop: validate -> data -> mesh -> compiled steps -> restore or init -> train, eval, log, save.

Everything that can be wrong with the input (layout, config, data, a checkpoint from another model) is checked
before the first compile, and before anything is written to WORKDIR.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import jax
import numpy as np

from jaxpar import data, distributed, metrics, monitor, watchdog
from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ConfigError, validate
from jaxpar.mesh import make_mesh
from jaxpar.step import build

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "try again"; the SLURM template requeues on it


class Preempted(Exception):
    """Raised after SIGTERM once a complete checkpoint of step `step` is on disk; train.py exits with
    PREEMPTED_EXIT_CODE."""

    def __init__(self, step: int):
        super().__init__(f"preempted (SIGTERM): checkpoint of step {step} saved; rerun the same command to resume.")
        self.step = step


class PreemptionWatch:
    """Notes SIGTERM (what SLURM sends before it kills a job, `#SBATCH --signal`) and, at each step boundary, says
    whether to stop there. With several processes every one stops at the same step: the flag is all-gathered, so a
    signal seen by any process stops all of them at the next boundary."""

    def __init__(self):
        import signal

        self.requested = False
        self._signal = signal
        self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame):
        self.requested = True

    def reached(self) -> bool:
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.asarray(self.requested))))

    def close(self):
        self._signal.signal(self._signal.SIGTERM, self._previous)


# What a resume must keep identical (else: refuse before touching anything). Layout, zero stage, schedule,
# microbatches, precision, cadence and steps may change; the global batch size too with train.allow_batch_change.
FINGERPRINT_KEYS = ("model.seq_len", "model.layers", "model.embed", "model.heads", "model.mlp",
                    "model.tie_embeddings", "train.global_batch_size")


def fingerprint(config, info, steps) -> dict:
    fp = {k: _get(config, k) for k in FINGERPRINT_KEYS}
    fp.update(vocab_real=steps.cfg.vocab_real, mlp_width=steps.cfg.mlp, tokenizer=info.meta.get("tokenizer"),
              data=os.path.basename(info.dir))
    return fp


def _get(config, dotted):
    sect, key = dotted.split(".")
    return config[sect][key]


def check_resume(saved: dict, now: dict, allow_batch_change: bool = False) -> None:
    """Raise ConfigError naming every difference between a checkpoint's fingerprint and this run's.

    `allow_batch_change` (`train.allow_batch_change`) accepts a different `train.global_batch_size`."""
    batch = "train.global_batch_size"
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {now[k]!r}" for k in now
             if saved.get(k) != now[k] and not (allow_batch_change and k == batch)]
    if diffs:
        hint = ("\nto continue the data order with the new batch size, pass --config.train.allow_batch_change=True."
                if any(d.startswith(batch + ":") for d in diffs) else "")
        raise ConfigError("refusing to resume: the checkpoint was written for another model or data:\n  "
                          + "\n  ".join(diffs)
                          + "\nuse a fresh --workdir, or restore the original settings." + hint)


def samples_consumed(meta: dict, step: int, batch: int) -> int:
    """Positions of the training order consumed before `step`, from the meta of checkpoint `step`: its `samples`,
    or (checkpoints written before it was recorded) `step` x the global batch size of its fingerprint (else `batch`)."""
    if "samples" in meta:
        return int(meta["samples"])
    return int(step) * int(meta.get("fingerprint", {}).get("train.global_batch_size", batch))


def n_params_for_flops(params, tied: bool) -> int:
    """N of PaLM's 6N: all parameters except position embeddings (the tied embedding counted once)."""
    return int(sum(np.prod(v.shape) for k, v in params.items() if k != "wpe" for v in jax.tree.leaves(v)))


def check_health(config, state, done: int) -> dict:
    """Raise FloatingPointError if training must stop: a non-finite loss/grad under `train.nonfinite = stop` (every
    update since was skipped, so the state is the last good step's), or fp16 overflows persisting at the minimum
    loss scale. Called before every log and save, so a NaN never reaches a checkpoint."""
    from jaxpar import loss_scale

    bad, first, ls = jax.device_get((state["nonfinite"], state["first_nonfinite"], state["loss_scale"]))
    if bad and config.train.nonfinite == "stop":
        raise FloatingPointError(
            f"non-finite loss or gradients at step {int(first)} (checked at step {done}); that update and every "
            f"later one were skipped, and no checkpoint was written since. Resume from the last checkpoint, or set "
            f"--config.train.nonfinite=skip to skip such steps and go on.")
    ls_cfg = loss_scale.from_config(config)
    if config.train.compute_dtype == "float16" and bool(loss_scale.should_stop(
            ls, ls_cfg, int(config.train.loss_scale_patience))):
        raise FloatingPointError(
            f"float16 overflow in {int(ls.consecutive_min_overflows)} steps in a row at the minimum loss scale "
            f"{float(ls.scale)} (step {done}); try bfloat16 (--config.train.compute_dtype=bfloat16) or a lower lr.")
    return {"nonfinite_steps": int(bad), "overflow_steps": int(ls.overflows)}


def check_export(directory: str, cfg) -> None:
    """Check that the export in `directory` holds the model `cfg` (a `GPTConfig`) describes, reading only its
    model_config.json; the trainer calls it before anything is written.

    Raises:
      ConfigError: the export is missing or unreadable, or its model differs from `cfg` (shape or vocabulary).
    """
    from jaxpar.export import read_export_config

    try:
        got = read_export_config(directory)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--config.init_from={directory}: {e}") from e
    diffs = [f"{f}: export {getattr(got, f)!r} vs config {getattr(cfg, f)!r}"
             for f in ("vocab_size", "vocab_real", "seq_len", "layers", "embed", "heads", "mlp", "tie_embeddings")
             if getattr(got, f) != getattr(cfg, f)]
    if diffs:
        raise ConfigError(f"--config.init_from={directory} holds another model:\n  " + "\n  ".join(diffs))


def init_from_export(directory: str, steps, state) -> dict:
    """`state` with its params replaced by those of an export (`python -m jaxpar.export`), placed in this layout.

    Raises:
      ConfigError: the export's model differs from this config's (shape or vocabulary).
    """
    from jaxpar.export import load_export

    check_export(directory, steps.cfg)
    _, params, _ = load_export(directory)
    canon = steps.to_canonical(state)
    canon["params"] = jax.device_put(
        jax.tree.map(lambda p, q: p.astype(q.dtype), params, canon["params"]), steps.state_shardings["params"])
    return steps.from_canonical(canon)


def dry_run(config, workdir: str) -> dict:
    """Compile the train step for the config's layout without training; write WORKDIR/compile_report.json.

    The report holds per-device bytes (XLA's memory analysis: arguments, outputs, temporaries, peak; and, from the
    shardings, params, optimizer state and the float32 gradient buffer), the analytic model FLOPs per step, and every
    collective of the compiled step by kind with its bytes and executions per step (loop trip counts applied)."""
    from jaxpar import report

    shape = validate(config, jax.device_count())
    vocab = max(int(config.model.vocab_size), 0) or distributed.process_0_first(
        lambda: data.prepare(config), "jaxpar/prepare").vocab_size
    steps = build(config, make_mesh(shape), vocab)
    abstract = steps.abstract_state()
    B, T = int(config.train.global_batch_size), int(config.model.seq_len)
    batch = {"tokens": jax.ShapeDtypeStruct((B, T + 1), np.int32, sharding=steps.batch_sharding)}
    n = n_params_for_flops(abstract["params"], steps.cfg.tie_embeddings)
    fpt = metrics.model_flops_per_token(n, steps.cfg.layers, steps.cfg.embed, T)
    rep = report.compile_report(steps.train.lower(abstract, batch), abstract_state=abstract,
                                flops_per_step=fpt * B * T)
    grads = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=sh),
                         abstract["params"], steps.grad_shardings)
    rep["state_bytes"]["grad_buffer"] = report.state_group_bytes({"g": grads})["g"]
    rep["layout"] = {**dict(steps.mesh.shape), "zero_stage": int(config.optim.zero_stage),
                     "microbatches": int(config.train.microbatches), "schedule": config.pipeline.schedule,
                     "params": int(sum(np.prod(a.shape) for a in jax.tree.leaves(abstract["params"]))),
                     "compute_dtype": config.train.compute_dtype, "param_dtype": config.train.param_dtype}
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "compile_report.json"), "w") as f:
            json.dump(rep, f, indent=2)
        print(f"layout {rep['layout']}")
        print(report.format_table(rep))
        print(f"written to {os.path.join(workdir, 'compile_report.json')}")
    return rep


def run(config, workdir: str, devices=None) -> dict:
    """Train `config` in `workdir` (resuming from its latest checkpoint). Returns the last logged metrics.

    `devices`: the devices to lay the mesh over (default: all, `jax.devices()`); a subset (e.g. one device of a
    process that has eight) is meant for tests and single-process runs."""
    is_main = jax.process_index() == 0
    devices = list(jax.devices() if devices is None else devices)
    shape = validate(config, len(devices))
    info = distributed.process_0_first(lambda: data.prepare(config), "jaxpar/prepare")  # once, then the others
    B, T, seed = int(config.train.global_batch_size), int(config.model.seq_len), int(config.train.seed)
    vocab = max(int(config.model.vocab_size), info.vocab_size)
    train_data = data.Batches(info, "train", T, B, seed, vocab_size=vocab)
    val_data = data.Batches(info, "val", T, B, seed, vocab_size=vocab)
    mesh = make_mesh(shape, devices)
    steps = build(config, mesh, vocab)

    ckpt_dir = os.path.join(workdir, "checkpoints")
    fp = fingerprint(config, info, steps)
    latest = None
    if os.path.isdir(ckpt_dir):  # refuse a mismatched resume before anything is created or written
        probe = Checkpointer(workdir, 1, 1, async_save=False, read_only=True)
        latest = probe.latest_step()
        if latest is not None:
            check_resume(probe.read_meta(latest).get("fingerprint", {}), fp, bool(config.train.allow_batch_change))
        probe.close()
    if config.init_from and latest is None:  # likewise a fine-tuning start from an export of another model
        check_export(config.init_from, steps.cfg)
    distributed.barrier("jaxpar/resume_check")  # every process looked (isdir) before process 0 creates the folder

    if is_main:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
        tok_dir = os.path.join(workdir, "tokenizer")
        if not os.path.isdir(tok_dir):
            shutil.copytree(info.tokenizer_dir, tok_dir)
    ckpt = Checkpointer.from_config(workdir, config)
    latest = ckpt.latest_step()
    abstract = steps.abstract_state()
    if latest is not None:
        state, meta = ckpt.restore(latest, abstract)
        state = steps.from_canonical(state)
        start = int(state["step"])
        train_data.resume_at(start, samples_consumed(meta, start, B))  # continue the order, whatever the batch size
    else:
        state, start = steps.init(seed), 0
        if config.init_from:  # fine-tuning: params from an export, fresh optimizer state, step 0
            state = init_from_export(config.init_from, steps, state)

    rows = data.process_rows(steps.batch_sharding, B)
    batch_at = lambda src, i: {"tokens": data.to_global(src(i, *rows), steps.batch_sharding, B)}
    flops_tok = metrics.model_flops_per_token(
        n_params_for_flops(abstract["params"], steps.cfg.tie_embeddings), steps.cfg.layers,
        steps.cfg.embed, T)
    peak = metrics.peak_flops(devices[0].device_kind)
    ndev = len(devices)
    writer = monitor.MetricsWriter(workdir, is_main)
    console = monitor.Console(is_main, int(config.train.steps), start, bool(config.log.progress))
    profiler = monitor.profile(workdir, tuple(config.log.profile_steps))
    if is_main:
        console.print(f"jaxpar: mesh {dict(mesh.shape)} on {ndev} {devices[0].platform} devices, "
                      f"{sum(np.prod(v.shape) for v in jax.tree.leaves(state['params'])):,} params, "
                      f"start step {start}, workdir {workdir}")

    # compiled before the step watchdog is armed, so that a first evaluation's compile never counts as a stall
    tokens = jax.ShapeDtypeStruct((B, T + 1), np.int32, sharding=steps.batch_sharding)
    eval_step = steps.evaluate.lower(abstract["params"], {"tokens": tokens}).compile()

    def evaluate():
        tot, n = 0.0, 0.0
        for i in range(int(config.eval.batches)):
            s, c = eval_step(state["params"], batch_at(val_data.val_batch, i))
            tot, n = tot + float(s), n + float(c)
        return tot / max(n, 1.0)

    last, t0, since = {}, time.perf_counter(), 0
    total = int(config.train.steps)
    preemption = PreemptionWatch()
    dist = config.dist  # from the end of the first step (compiled) on; evaluation and saves count as the step's
    watchdog.arm_steps(float(dist.step_timeout_s), float(dist.step_timeout_min_s), float(dist.step_timeout_factor))
    try:
        for step in range(start, total):
            profiler.maybe_start(step)
            state, m = steps.train(state, batch_at(train_data.rows, step))
            profiler.maybe_stop(step, block_on=m["loss"])
            since += 1
            done = step + 1
            log_now = done % config.log.every_steps == 0 or done == total
            eval_now = done % config.eval.every_steps == 0 or done == total
            stop_now = preemption.reached()
            save_now = done % config.checkpoint.every_steps == 0 or done == total or stop_now
            if log_now or eval_now or save_now:
                health = check_health(config, state, done)
            if log_now or eval_now:
                m = {k: float(v) for k, v in jax.device_get(m).items()} | health
                dt = time.perf_counter() - t0
                tps = since * B * T / dt
                m.update(tokens_per_s=tps, step_time_s=dt / since,
                         tflops_per_device=metrics.tflops_per_device(tps, flops_tok, ndev),
                         mfu=metrics.mfu(tps, flops_tok, ndev, peak))
                m.update(metrics.device_memory_bytes() or {})
                if eval_now:
                    watchdog.phase("evaluation")
                    m["val_loss"] = evaluate()
                writer.write(done, m)
                console.update(done, m)
                last = dict(m, step=done)
                t0, since = time.perf_counter(), 0
            else:
                console.update(done)
            if save_now:
                watchdog.phase("checkpoint save")
                ckpt.save(done, steps.to_canonical(state),
                          {"fingerprint": fp, "step": done, "samples": train_data.samples_before(done)}, force=True)
            if stop_now:
                watchdog.phase("checkpoint save")
                ckpt.wait()
                raise Preempted(done)
            watchdog.beat(done)
        ckpt.wait()
    finally:
        watchdog.disarm()
        preemption.close()
        profiler.stop()
        console.close()
        writer.close()
        ckpt.close()
    return last
