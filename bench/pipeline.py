"""Pipeline bubbles on fake CPU devices: total work, schedule time and memory per (stages, microbatches, schedule).

    python bench/pipeline.py [--quick] [--out_dir bench/results] [--markdown] [--steps 5] [--cores 1]

For S pipeline stages (mesh data x tensor x stage = 1 x 1 x S on the first S of 8 fake CPU devices), M microbatches
of one sequence each (global batch M) and each schedule of `--schedules` (`gpipe`; `circular` with v = 2 chunks per
stage; `1f1b` and `zb_h1`, whose backward runs inside the loop), on a tiny GPT:

  work_ratio      step time(S, M, v) / step time(1, M) (same model, batch and M; S = 1 is plain gradient
                  accumulation). The fake devices share the host's cores (by default the process is pinned to one
                  core, `--cores`), so this is the compute the pipeline spends relative to one device: bubbles
                  computed and thrown away (`skip_bubbles=False`), or skipped (`skip_bubbles=True`), plus the
                  pipeline's own overhead (with `pipeline.remat` the backward pass recomputes each stage's forward).
                  Median of `--steps` timed steps after one warm-up step, alternating with the S = 1 step so that a
                  change in the host's load hits both; compilation excluded (`work_ratio_min`: the same from the
                  fastest steps, steadier on a busy host).
  schedule_ratio  critical path / ideal, read off the schedule's tick table: each tick runs at most one slot per
                  stage, so a tick with any work costs one chunk (L / (S·v) layers on one microbatch); the forward
                  pass walks the table, the backward pass (autodiff of the scan) walks it back. Chunk costs t_f and
                  t_b are measured on one device (jitted `Forward.layers` and the pullback of its `jax.vjp`); a
                  backward tick costs t_b, plus t_f when `pipeline.remat` recomputes the forward. Ideal: v·M chunks
                  each way with no waiting. Next to it: theory_ratio = (v·M + S - 1) / (v·M), and the schedule's
                  bubble fraction (S - 1) / (v·M + S - 1). For 1f1b and zb_h1: the `Schedule.time` of the
                  tick table with equal F, B and W costs over the ideal 3M, next to theory_ratio = (M + S - 1) / M
                  (1F1B) and (M + (S - 1)/3) / M (ZB-H1, Qi et al. 2023, sec. 3).
  peak_bytes      per device, from the compiled train step's memory analysis: argument + output + temp - alias.

Prints one JSON list of rows on stdout (with `--markdown`, a README table instead) and a markdown table on stderr;
writes pipeline.json, pipeline.md and pipeline.png (work, schedule and memory panels) to `--out_dir`.
"""
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jaxpar.parallel import pipeline  # noqa: E402
from common import m_axis, write_results  # noqa: E402
from jaxpar.config import ConfigError, base_config  # noqa: E402
from jaxpar.compiled import steps_for  # noqa: E402
from jaxpar.parallel.mesh import make_mesh  # noqa: E402
from jaxpar.model import split_params  # noqa: E402
from jaxpar.analysis.compile_report import memory_bytes  # noqa: E402
from jaxpar.train.step import build, map_blocks  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "small sweep: S in {1, 2, 4}, M in {S, 4S}, gpipe and 1f1b")
_STAGES = flags.DEFINE_list("stages", ["1", "2", "4", "8"], "pipeline stages S")
_MULT = flags.DEFINE_list("mult", ["1", "2", "4", "8"], "microbatches M as multiples of S")
_SCHEDULES = flags.DEFINE_list("schedules", list(pipeline.NAMES),
                                "pipeline schedules (circular runs v = 2 chunks per stage)")
_STEPS = flags.DEFINE_integer("steps", 5, "timed train steps per configuration (after one warm-up step)")
_CORES = flags.DEFINE_integer("cores", 1, "pin the process to this many CPU cores before JAX starts (0: no pinning)")
_LAYERS = flags.DEFINE_integer("layers", 16, "model layers (S·v must divide it)")
_EMBED = flags.DEFINE_integer("embed", 64, "model width")
_HEADS = flags.DEFINE_integer("heads", 4, "attention heads")
_SEQ = flags.DEFINE_integer("seq_len", 32, "sequence length")
_VOCAB = flags.DEFINE_integer("vocab", 256, "vocabulary size")
_REMAT = flags.DEFINE_bool("pipeline_remat", True, "config pipeline.remat (recompute stage forwards in backward)")
_OUT = flags.DEFINE_string("out_dir", "bench/results", "where pipeline.json/.md/.png go ('' : nowhere)")
_MARKDOWN = flags.DEFINE_bool("markdown", False, "print the markdown table on stdout instead of the JSON")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def make_config(S, M, name, skip):
    v = 2 if name == "circular" else 1
    c = base_config()
    c.name = "bench_pipeline"
    c.model.update(vocab_size=_VOCAB.value, seq_len=_SEQ.value, layers=_LAYERS.value, embed=_EMBED.value,
                   heads=_HEADS.value, mlp=4 * _EMBED.value)
    c.mesh.update(data=1, tensor=1, stage=S)
    c.train.update(global_batch_size=M, microbatches=M)
    c.optim.update(warmup_steps=0, decay_steps=10)
    c.pipeline.update(schedule=name if S > 1 else "gpipe", virtual_stages=v, skip_bubbles=bool(skip),
                      remat=_REMAT.value)
    return c


class Runner:
    """The compiled train step of one config on its devices, with its (donated, updated) state and a fixed batch."""

    def __init__(self, config, devices, canonical_state):
        steps = steps_for(config, _VOCAB.value, devices)
        S = steps.layout.stage
        v = pipeline.virtual_stages(config.pipeline.schedule, S, int(config.pipeline.virtual_stages))
        B, T = int(config.train.global_batch_size), int(config.model.seq_len)
        tokens = np.random.default_rng(0).integers(0, _VOCAB.value, (B, T + 1), dtype=np.int32)
        self.batch = {"tokens": jax.device_put(tokens, steps.batch_sharding)}
        # the same initial values in every layout, without compiling `init` per layout: host arrays in this layout's
        # layer order, placed with its shardings
        local = map_blocks(canonical_state, lambda a: pipeline.to_stage_major(a, S, v if S > 1 else 1))
        self.state = jax.device_put(local, steps.state_shardings)
        t0 = time.perf_counter()
        self.compiled = steps.train.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        self.mem = memory_bytes(self.compiled)
        self.state, m = self.compiled(self.state, self.batch)  # warm-up
        jax.block_until_ready((self.state, m))
        self.loss0 = float(m["loss"])

    def step(self) -> float:
        t0 = time.perf_counter()
        self.state, m = self.compiled(self.state, self.batch)
        jax.block_until_ready((self.state, m))
        return time.perf_counter() - t0


def time_call(f, *args, inner=20, outer=7) -> float:
    """Median over `outer` rounds of the mean time of `inner` back-to-back calls (after a warm-up call)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(outer):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / inner)
    return statistics.median(ts)


def chunk_costs(fwd, blocks, n_layers, device) -> tuple[float, float]:
    """(t_f, t_b): forward and backward time of `n_layers` layers on one microbatch `[1, seq, embed]`, one device."""
    p = jax.device_put(jax.tree.map(lambda a: a[:n_layers], blocks), device)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (1, _SEQ.value, _EMBED.value), jnp.float32), device)
    f = lambda p, x: fwd.layers(p, x)
    forward = jax.jit(f)
    y, pull = jax.jit(lambda p, x: jax.vjp(f, p, x))(p, x)
    backward = jax.jit(lambda pull, ct: pull(ct))
    return time_call(forward, p, x), time_call(backward, pull, jnp.ones_like(y))


def schedule_time(sched: pipeline.Schedule, t_f: float, t_b: float) -> tuple[float, float]:
    """(critical path, ideal) of forward then backward through the tick table; a tick costs one chunk per slot it
    runs on a stage, i.e. the busiest stage's slots (at most one) times the chunk's cost."""
    slots = sched.ok["f"].astype(np.int64).max(axis=1)  # [ticks]: slots on the busiest stage (0 or 1)
    crit = float(slots.sum()) * t_f + float(slots[::-1].sum()) * t_b
    ideal = sched.virtual * sched.microbatches * (t_f + t_b)
    return crit, ideal


def sweep() -> list[dict]:
    if _QUICK.value:
        stages, mults, names = [1, 2, 4], [1, 4], ["gpipe", "1f1b"]
    else:
        stages, mults, names = [int(s) for s in _STAGES.value], [int(k) for k in _MULT.value], _SCHEDULES.value
    devices = jax.devices("cpu")
    if max(stages) > len(devices):
        raise SystemExit(f"need {max(stages)} CPU devices, have {len(devices)}: set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={max(stages)} (now {os.environ.get('XLA_FLAGS')!r})")
    combos = []
    for S in (S for S in stages if S > 1):
        for name in names:
            v = 2 if name == "circular" else 1
            if _LAYERS.value % (S * v):
                log(f"skipping S={S} {name}: layers={_LAYERS.value} not divisible by S·v={S * v}")
            else:
                combos.append((S, name))
    n = _STEPS.value
    probe = build(make_config(1, 1, "gpipe", True), make_mesh({"data": 1, "tensor": 1, "stage": 1}, devices[:1]),
                  _VOCAB.value)
    canonical = jax.device_get(probe.init(0))  # every layout starts from these values (S = 1 is canonical order)
    rows, base = [], {}

    def row(S, M, v, name, skip, r: Runner, step_s, **extra):
        return {"S": S, "M": M, "v": v, "schedule": name, "skip": skip, "step_s": step_s, **extra,
                "peak_bytes": r.mem.get("peak"), "temp_bytes": r.mem.get("temp"), "loss0": r.loss0,
                "compile_s": r.compile_s}

    for M in sorted({S * k for S in stages for k in mults}):  # S = 1: gradient accumulation on one device
        r = base[M] = Runner(make_config(1, M, "gpipe", True), devices[:1], canonical)
        ts = [r.step() for _ in range(n)]
        step_s = statistics.median(ts)
        rows.append(row(1, M, 1, "none", None, r, step_s, step_min_s=min(ts), base_step_s=step_s, work_ratio=1.0,
                        work_ratio_min=1.0, schedule_ratio=1.0, theory_ratio=1.0, bubble_fraction=0.0, ticks=M,
                        t_f=None, t_b=None))
        log(f"S=1 M={M:3d}: step {step_s * 1e3:8.2f} ms, peak {r.mem.get('peak', 0) / 2**20:.2f} MiB, "
            f"compile {r.compile_s:.1f} s")

    blocks = split_params(canonical["params"])[1]
    for S, name in combos:
        v = 2 if name == "circular" else 1
        Lc = _LAYERS.value // (S * v)
        t_f, t_b = chunk_costs(probe.fwd, blocks, Lc, devices[0])
        t_bt = t_b + (t_f if _REMAT.value else 0.0)  # a backward tick re-runs the stage's forward under remat
        log(f"S={S} v={v}: chunk of {Lc} layers: t_f {t_f * 1e3:.3f} ms, t_b {t_b * 1e3:.3f} ms")
        for k in mults:
            M = S * k
            if pipeline.SCHEDULES[name].engine == "loop":
                sched = pipeline.table(name, S, M)
                theory = (M + S - 1) / M if name == "1f1b" else (M + (S - 1) / 3) / M
                info = dict(schedule_ratio=sched.time() / (3 * M), theory_ratio=theory,
                            bubble_fraction=1 - 3 * M / sched.time(), ticks=sched.ticks, t_f=t_f, t_b=t_bt)
            else:
                sched = pipeline.table(name, S, M, v)
                crit, ideal = schedule_time(sched, t_f, t_bt)
                info = dict(schedule_ratio=crit / ideal, theory_ratio=(v * M + S - 1) / (v * M),
                            bubble_fraction=sched.bubble_fraction(), ticks=sched.ticks, t_f=t_f, t_b=t_bt)
            for skip in ((True,) if pipeline.SCHEDULES[name].engine == "loop" else (True, False)):
                try:
                    r = Runner(make_config(S, M, name, skip), devices[:S], canonical)
                except ConfigError as e:
                    log(f"skipping S={S} M={M} {name}: {e}")
                    continue
                if abs(r.loss0 - base[M].loss0) > 1e-5 * abs(base[M].loss0):
                    log(f"WARNING S={S} M={M} {name} skip={skip}: first loss {r.loss0} != {base[M].loss0} (S=1)")
                # alternate with the S = 1 step on the same batch, so a change in the host's load hits both
                tp, tb = [], []
                for _ in range(n):
                    tp.append(r.step())
                    tb.append(base[M].step())
                step_s, base_s = statistics.median(tp), statistics.median(tb)
                rows.append(row(S, M, v, name, skip, r, step_s, step_min_s=min(tp), base_step_s=base_s,
                                work_ratio=step_s / base_s, work_ratio_min=min(tp) / min(tb), **info))
                del r
                log(f"S={S} M={M:3d} {name:8s} skip={skip!s:5}: step {step_s * 1e3:8.2f} ms (S=1 {base_s * 1e3:.2f}), "
                    f"work {step_s / base_s:.3f}, schedule {info['schedule_ratio']:.3f} "
                    f"(theory {info['theory_ratio']:.3f}), peak {rows[-1]['peak_bytes'] / 2**20:.2f} MiB, "
                    f"compile {rows[-1]['compile_s']:.1f} s")
    return rows


def markdown(rows) -> str:
    out = ["| S | schedule | M | theory | schedule (tick table) | work, skip | work, no skip | peak MiB |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["S"], r["schedule"], r["M"]) for r in rows}, key=lambda k: (k[0], ORDER.index(k[1]), k[2]))
    fmt = lambda x, f="{:.3f}": "–" if x is None else f.format(x)
    for S, name, M in keys:
        rs = {r["skip"]: r for r in rows if (r["S"], r["schedule"], r["M"]) == (S, name, M)}
        any_r = next(iter(rs.values()))
        skip_r = rs.get(True, rs.get(None))
        no_r = rs.get(False)
        peak = (skip_r or any_r)["peak_bytes"]
        out.append(f"| {S} | {name} | {M} | {any_r['theory_ratio']:.3f} | {any_r['schedule_ratio']:.3f} | "
                   f"{fmt(skip_r and skip_r['work_ratio'])} | {fmt(no_r and no_r['work_ratio'])} | "
                   f"{fmt(peak and peak / 2**20, '{:.2f}')} |")
    return "\n".join(out)


ORDER = ["none", "gpipe", "circular", "1f1b", "zb_h1"]


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (aw, asch, am) = plt.subplots(1, 3, figsize=(17, 5.5))
    colors = dict(zip(ORDER[1:], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    markers = dict(zip(sorted({r["S"] for r in rows if r["S"] > 1}), "osD^v"))
    for S, name in sorted({(r["S"], r["schedule"]) for r in rows if r["S"] > 1}):
        c, mk, label = colors[name], markers[S], f"{name} S={S}"
        rs = sorted((r for r in rows if (r["S"], r["schedule"]) == (S, name) and r["skip"] is not False),
                    key=lambda r: r["M"])
        ms = [r["M"] for r in rs]
        aw.plot(ms, [r["work_ratio"] for r in rs], "-", color=c, marker=mk, label=label)
        am.plot(ms, [r["peak_bytes"] / 2**20 for r in rs], "-", color=c, marker=mk, label=label)
        asch.plot(ms, [r["schedule_ratio"] for r in rs], "-", color=c, marker=mk, label=label + " tick table")
        asch.plot(ms, [r["theory_ratio"] for r in rs], mk, color="k", mfc="none", ms=11)
    base = sorted((r for r in rows if r["S"] == 1), key=lambda r: r["M"])
    if base:
        am.plot([r["M"] for r in base], [r["peak_bytes"] / 2**20 for r in base], "-", color="k", marker="x",
                label="S=1 (accumulation)")
    aw.axhline(1.0, color="k", lw=0.8)
    asch.axhline(1.0, color="k", lw=0.8)
    aw.set(title="total work: step time / step time (S=1), bubbles skipped", xlabel="microbatches M",
           ylabel="work ratio")
    asch.set(title="schedule: critical path / ideal (tick table)\nopen black markers: theory",
             xlabel="microbatches M", ylabel="schedule ratio")
    am.set(title="per-device peak bytes of the train step\n(argument + output + temp − alias)",
           xlabel="microbatches M", ylabel="MiB")
    ms = sorted({r["M"] for r in rows})
    for ax in (aw, asch, am):
        m_axis(ax, ms)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if _CORES.value > 0 and hasattr(os, "sched_setaffinity"):
        # before the CPU client starts its threads (they inherit the mask): all fake devices share these cores
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:_CORES.value])
    t0 = time.perf_counter()
    rows = sweep()
    table = markdown(rows)
    log(f"\n{table}\n\n{len(rows)} rows in {time.perf_counter() - t0:.1f} s "
        f"(cores {sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'})")
    write_results(_OUT.value, "pipeline", rows, table, plot)
    print(table if _MARKDOWN.value else json.dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(main)
