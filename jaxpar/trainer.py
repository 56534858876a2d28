"""The training loop: validate -> data -> mesh -> compiled steps -> restore or init -> train, eval, log, save.

Everything that can be wrong with the input (layout, config, data, a checkpoint from another model) is checked
before the first compile, and before anything is written to WORKDIR. The data is opened as the objective reads it
(`jaxpar/train/inputs.py`), a resume checked against the checkpoint's fingerprint (`jaxpar/state/resume.py`), the
metrics written by `jaxpar/observe/monitor.py`.
"""
from __future__ import annotations

import collections
import json
import os
import shutil

import jax
import numpy as np

from jaxpar.analysis import compile_report as report
from jaxpar import data
from jaxpar.analysis import throughput
from jaxpar.cluster import distributed, watchdog
from jaxpar.cluster.preemption import Preempted, PreemptionWatch
from jaxpar.formats import hf, hub, peft
from jaxpar.formats import start as starting_point
from jaxpar.state import runs
from jaxpar.observe import monitor
from jaxpar.train import loss_scale, reference
from jaxpar import model as gpt
from jaxpar.state.checkpoint import Checkpointer
from jaxpar.compiled import abstract_batch, ref_dtype, report_for, steps_for
from jaxpar.config import ConfigError  # noqa: F401 (trainer.ConfigError: what a run raises for bad input)
from jaxpar.evaluate import during as lm_tasks
from jaxpar.state.resume import check_resume, fingerprint, latest_checkpoint
from jaxpar.train import objectives
from jaxpar.train.feed import TokenFeed, reference_of, to_global
from jaxpar.train.inputs import open_data, say_packing
from jaxpar.rl.rounds import Rounds
from jaxpar.plan import target
from jaxpar.generate import cache as kv_cache
from jaxpar.train.step import model_config
from jaxpar.validate import validate

def check_health(config, state, done: int) -> dict:
    """Raise FloatingPointError if training must stop: a non-finite loss/grad under `train.nonfinite = stop` (every
    update since was skipped, so the state is the last good step's), or fp16 overflows persisting at the minimum
    loss scale. Called before every log and save, so a NaN never reaches a checkpoint."""
    bad, first, ls, sp = jax.device_get((state["nonfinite"], state["first_nonfinite"], state["loss_scale"],
                                         state["spikes"]["skipped"]))
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
    return {"nonfinite_steps": int(bad), "overflow_steps": int(ls.overflows), "spike_steps": int(sp)}


def dry_run(config, workdir: str) -> dict:
    """Compile the train step for the config's layout without training; write WORKDIR/compile_report.json.

    The report holds per-device bytes (XLA's memory analysis: arguments, outputs, temporaries, peak; and, from the
    shardings, params, optimizer state and the float32 gradient buffer), the analytic model FLOPs per step, and every
    collective of the compiled step by kind with its bytes and executions per step (loop trip counts applied);
    WORKDIR/train_step.hlo.txt is the optimized HLO it was read from."""
    needs_data = (config.data.tokenizer == "bpe" and not int(config.model.vocab_size)  # the vocabulary trains on it
                  or config.data.packing == "auto" and not objectives.from_config(config).packing)  # (the records')
    resolved = hub.resolve_once_per_host(config, workdir, weights=False, datasets=needs_data)[0]
    # `auto` as the target (mesh.device, or the devices present) runs it
    rep = report_for(resolved, resolve=target.resolve)
    rep["kv_cache"] = kv_cache.dry_run_entry(resolved, jax.device_count())  # generation on this layout
    hlo = rep.pop("hlo_text")
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "compile_report.json"), "w") as f:
            json.dump(rep, f, indent=2)
        with open(os.path.join(workdir, "train_step.hlo.txt"), "w") as f:  # the optimized HLO the report reads
            f.write(hlo)
        print(f"layout {rep['layout']}")
        if rep["resolved"]:
            print(rep["resolved"]["why"])
        lay = rep["layout"]
        if lay["trainable"] < lay["params"]:  # LoRA: the gradient buffer and AdamW's moments are the adapters'
            print(f"trainable parameters {lay['trainable']:,} of {lay['params']:,} "
                  f"({100 * lay['trainable'] / lay['params']:.2f} %: the LoRA adapters; the base is frozen)")
        print(report.format_table(rep))
        kv = rep["kv_cache"]
        print(f"KV cache (generation, {kv['rows']} rows x {kv['positions']} positions): {kv['per_device']:,} bytes "
              f"per device, {kv['total']:,} in all (docs/generate.md)")
        if "paged" in kv:
            pg = kv["paged"]
            print(f"paged KV pool (grpo.kv_block, grpo.kv_cache_gib): {pg['kv_blocks']:,} blocks of {pg['block']} "
                  f"positions, {pg['per_device']:,} bytes per device, {pg['total']:,} in all")
        print(f"written to {os.path.join(workdir, 'compile_report.json')}")
    return rep


def run(config, workdir: str, devices=None) -> dict:
    """Train `config` in `workdir` (resuming from its latest checkpoint). Returns the last logged metrics.

    `devices`: the devices to lay the mesh over (default: all, `jax.devices()`); a subset (e.g. one device of a
    process that has eight) is meant for tests and single-process runs."""
    devices = list(jax.devices() if devices is None else devices)
    named = config  # hf:ORG/NAME, hfds:ORG/NAME -> where they are in the HF cache; the weights once validated
    config, pins = hub.resolve_once_per_host(named, workdir, weights=False)
    # init_from (hf:DIR, an export, a run): its shape and tokenizer; lora.adapter: its r, ...; a ViT's patches
    config = objectives.with_packing(gpt.derived(peft.apply(starting_point.apply(config))))
    layout = validate(config, len(devices))
    target.check(config, devices)  # mesh.device, and the devices `auto` is priced for: before the data
    hub.resolve_once_per_host(named, workdir, weights=True, pins=pins, datasets=False)  # (datasets: fetched above)
    check_hf_weights(config, workdir, layout.tensor)  # before data preparation, which can take hours
    info, (train_data, val_data), vocab = open_data(config)
    if "prompts" in objectives.from_config(config).data_kinds:
        Rounds.check(config)  # the reward functions, before anything compiles
    say_packing(train_data, val_data)
    config, resolved = target.resolve(config, vocab, layout, devices)  # `auto` as the cost model prices it here
    if resolved and jax.process_index() == 0:
        print(f"jaxpar: {resolved['why']}", flush=True)
    steps = steps_for(config, vocab, devices, layout)
    fp = fingerprint(config, info, steps)
    latest = check_before_writing(config, workdir, fp, steps)
    if latest is not None and latest >= int(config.train.steps):
        return nothing_to_run(config, workdir, latest)
    if jax.process_index() == 0:
        write_run_files(config, workdir, info, latest or 0)
        hub.record(workdir, pins)
    ckpt = Checkpointer.from_config(workdir, config)
    try:
        abstract = steps.abstract_state()
        feed = feed_for(config, workdir, steps, info, (train_data, val_data), abstract)
        state, start = starting_point.initial_state(config, steps, ckpt, feed, abstract)
        if ref_dtype(config) is not None:  # DPO's reference sums, computed from the starting weights, kept in workdir
            precompute_reference(config, workdir, steps, state, start, info, (train_data, val_data))
        loop = Loop(config, workdir, steps, ckpt, devices, fp, feed, start)
        return loop.run(state, start)
    finally:
        ckpt.close()


def feed_for(config, workdir: str, steps, info, splits, abstract):
    """The loop's batches: an RL objective's rounds sampled from its prompts (`rl.rounds.Rounds`), else the prepared
    data's rows (`train.feed.TokenFeed`, its evaluation step compiled now, before the step watchdog is armed)."""
    if "prompts" in steps.objective.data_kinds:
        return Rounds(config, steps, info, splits, workdir, jax.process_index() == 0)
    eval_step = steps.evaluate.lower(abstract["params"], abstract_batch(config, steps),
                                     *reference_of(abstract)).compile()
    return TokenFeed(config, steps, *splits, eval_step, ref_dtype(config), int(config.train.steps))


def precompute_reference(config, workdir: str, steps, state, start: int, info, splits) -> None:
    """DPO's reference tables (`dpo.precompute_reference`): read back, or at step 0 computed from the starting weights
    (`state`'s params) and recorded with what made them (`reference.attach`)."""
    B = int(config.train.global_batch_size)
    run_batch = lambda rows: steps.reference_sums(state["params"], to_global(rows, steps, B, ref_dtype(config)))
    start_weights = state["params"] if config.lora.adapter or not steps.cfg.lora_rank else \
        gpt.split_trainable(state["params"], steps.cfg)[1]  # (fresh adapters are not the reference's)
    made_by = {"init_from": config.init_from, "lora.adapter": config.lora.adapter, "data": info.identity,
               "weights": reference.weights_digest(start_weights) if start == 0 else None}
    reference.attach(workdir, splits, start, lambda rows: np.asarray(jax.device_get(run_batch(rows))),
                     data.process_rows(steps.batch_sharding, B), made_by)


def check_before_writing(config, workdir: str, fp: dict, steps) -> int | None:
    """Refuse a mismatched resume (or a fine-tuning start from an export of another model) before anything is
    created or written. -> the latest checkpoint's step (None: a fresh run)."""
    latest, meta = latest_checkpoint(workdir)
    if latest is not None:
        check_resume(meta.get("fingerprint", {}), fp, bool(config.train.allow_batch_change))
    if config.init_from and latest is None and hf.directory_of(config.init_from) is None:
        starting_point.check(config.init_from, steps.cfg)  # (hf:DIR: `check_hf_weights`, before the data)
    distributed.barrier("jaxpar/resume_check")  # every process looked (isdir) before process 0 creates the folder
    return latest


def nothing_to_run(config, workdir: str, latest: int) -> dict:
    """A resume of a finished run: say so (nothing is written) and return no metrics."""
    if jax.process_index() == 0:
        print(f"jaxpar: nothing to run: {workdir} holds the checkpoint of step {latest} and train.steps="
              f"{int(config.train.steps)} is reached; raise --config.train.steps to train further.", flush=True)
    return {}


def check_hf_weights(config, workdir: str, tensor: int) -> None:
    """With `init_from = hf:DIR` and no checkpoint to resume: every tensor the model needs is in DIR's weight files,
    complete and of the shape config.json implies (headers only), and `lora.adapter`'s tensors fit the model, before
    anything is prepared or written."""
    directory = hf.directory_of(config.init_from)
    if (directory is None and not config.lora.adapter) or latest_checkpoint(workdir)[0] is not None:
        return
    cfg = model_config(config, int(config.model.vocab_size), tensor)
    if directory is not None:
        hf.check(directory, cfg)
    if config.lora.adapter:  # (its r, alpha and targets are the config's already: `peft.apply`)
        peft.check(config.lora.adapter, cfg)


def write_run_files(config, workdir: str, info, start: int) -> None:
    """WORKDIR/config.json (this start's resolved config: what `runs` reads), WORKDIR/starts/NNN-step-S.json (every
    start's, kept: the first run's layout is never lost) and WORKDIR/tokenizer (kept from the first run)."""
    os.makedirs(os.path.join(workdir, "starts"), exist_ok=True)
    text = config.to_json_best_effort(indent=2)
    n = len([f for f in os.listdir(os.path.join(workdir, "starts")) if f.endswith(".json")])
    for path in (os.path.join(workdir, "starts", f"{n:03d}-step-{start}.json"), os.path.join(workdir, "config.json")):
        with open(path, "w") as f:
            f.write(text)
    if isinstance(info, data.ImageInfo):  # the class names, index = label (what an export's id2label reads)
        with open(os.path.join(workdir, runs.CLASSES_FILE), "w") as f:
            json.dump(list(info.classes), f)
        return
    tok_dir = os.path.join(workdir, "tokenizer")
    if not os.path.isdir(tok_dir):
        shutil.copytree(info.tokenizer_dir, tok_dir)


# Steps the host may queue ahead of the devices before it waits for the oldest: enough to keep them busy, and a
# bound (XLA:CPU, whose runtime queues without limit, deadlocks in a collective with about a hundred steps queued)
AHEAD = 2


class Loop:
    """The train loop of one run: steps, and at their cadences logs, evaluation and checkpoints; SIGTERM stops it at
    a step boundary with a checkpoint; the step watchdog is armed while it runs."""

    def __init__(self, config, workdir, steps, ckpt, devices, fp, feed, start):
        self.config, self.steps, self.ckpt, self.fp, self.feed = config, steps, ckpt, fp, feed
        self.total = int(config.train.steps)
        self.spikes_said = 0  # spikes skipped when last said (`run` starts it at the resumed state's count)
        self.flops_tok = gpt.flops_per_token(steps.cfg)
        self.peak, self.ndev = throughput.peak_flops(devices[0].device_kind), len(devices)
        is_main = jax.process_index() == 0
        self.writer = monitor.writer_for(config, workdir, is_main)
        self.profiler = monitor.profile(workdir, tuple(config.log.profile_steps))
        self.console = monitor.Console(is_main, self.total, start, bool(config.log.progress))
        if is_main:
            counts = gpt.param_counts(steps.cfg)
            trained = (f" ({counts['trainable']:,} trainable: the LoRA adapters)"
                       if counts["trainable"] < counts["total"] else "")
            self.console.print(
                f"jaxpar: mesh {dict(steps.mesh.shape)} on {self.ndev} {devices[0].platform} devices, "
                f"{counts['total']:,} params{trained}, start step {start}, workdir {workdir}")
        self.lm_tasks = lm_tasks.Tasks(config, steps, workdir)  # eval.tasks: lm-eval's, their data read now

    def run(self, state, start: int) -> dict:
        self.spikes_said = int(jax.device_get(state["spikes"]["skipped"]))
        preemption = PreemptionWatch()
        dist = self.config.dist  # from the end of the first step (compiled) on; evaluation and saves count too
        watchdog.arm_steps(float(dist.step_timeout_s), float(dist.step_timeout_min_s), float(dist.step_timeout_factor))
        try:
            last = self._steps(state, start, preemption)
            self.ckpt.wait()
            return last
        finally:
            watchdog.disarm()
            preemption.close()
            self.profiler.stop()
            self.feed.close()
            self.console.close()
            self.writer.close()

    def _steps(self, state, start, preemption) -> dict:
        c, last, clock, self.ahead = self.config, {}, throughput.Interval(), collections.deque()
        for step in range(start, self.total):
            self.profiler.maybe_start(step)
            state, m = self.steps.train(state, self.feed.batch(step, state))
            self.ahead.append(m["loss"])
            if len(self.ahead) > AHEAD:  # the host stays at most AHEAD steps ahead of the devices
                jax.block_until_ready(self.ahead.popleft())
            self.profiler.maybe_stop(step, block_on=m["loss"])
            clock.add(self.feed.tokens)
            if step == start:  # the first step compiles: its time is no training time
                jax.block_until_ready(m["loss"])
                clock.restart()
            done = step + 1
            if done in c.train.skip_steps:
                self.console.print(f"step {done}: update skipped (train.skip_steps); its batch was read")
            log_now = done % c.log.every_steps == 0 or done == self.total
            eval_now = done % c.eval.every_steps == 0 or done == self.total
            stop_now = preemption.reached()
            save_now = done % c.checkpoint.every_steps == 0 or done == self.total or stop_now
            log_now = log_now or self.lm_tasks.due(done)
            if log_now or eval_now or save_now:
                health = check_health(c, state, done)
                self._say_spikes(state, health["spike_steps"])
            if log_now or eval_now:
                last = self._log(state, done, m, health, clock, eval_now)
                clock.restart()
            else:
                self.console.update(done)
            if save_now:
                watchdog.phase("checkpoint save")
                with clock.pause():
                    self.ckpt.save(done, self.steps.to_canonical(state),
                                   {"fingerprint": self.fp, "step": done, **self.feed.save(done)}, force=True)
            if stop_now:
                watchdog.phase("checkpoint save")
                self.ckpt.wait()
                raise Preempted(done)
            watchdog.beat(done)
        return last

    def _say_spikes(self, state, skipped: int) -> None:
        """A console line when loss spikes were skipped since the last look (`train.skip_spikes`)."""
        if skipped > self.spikes_said:
            last = int(jax.device_get(state["spikes"]["last"]))
            self.console.print(f"step {last}: update skipped (loss or gradient-norm spike, train.skip_spikes); "
                               f"{skipped - self.spikes_said} since the last log, {skipped} in all")
        self.spikes_said = skipped

    def _log(self, state, done, m, health, clock, eval_now) -> dict:
        m = {k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in jax.device_get(m).items()} | health
        if self.config.train.compute_dtype != "float16":  # loss scaling is fp16's alone
            m.pop("loss_scale", None)
        m.update(self.feed.log(done, clock.steps, self.writer))
        rates = clock.rates()
        if rates:
            tps = rates["tokens_per_s"]
            m.update(rates, tflops_per_device=throughput.tflops_per_device(tps, self.flops_tok, self.ndev),
                     mfu=throughput.mfu(tps, self.flops_tok, self.ndev, self.peak))
        m.update(throughput.device_memory_bytes() or {})
        if eval_now:
            watchdog.phase("evaluation")
            m.update(self.feed.evaluate(state))
        m.update(self.lm_tasks(done, state["params"]))  # eval/<task>/<metric> when eval.tasks are due
        self.writer.write(done, m)
        self.console.update(done, m)
        return dict(m, step=done)
