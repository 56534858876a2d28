"""Several processes as several hosts run them: `python -m jaxpar.launch` starts 2 processes x 4 CPU devices (gloo
collectives; each process its own node, so `data` spans processes), against 1 process x 8 devices, on
(data, tensor, stage) = (2, 2, 2), in float64 so that the comparison after optimizer steps is exact on any CPU. The two
reference runs are shared by the first two tests (module fixture)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest

from helpers import LOSS_F64_RTOL, assert_params_exact
from jaxpar import launch
from jaxpar.cluster.watchdog import PEER_LOST_EXIT_CODE, STALLED_EXIT_CODE
from jaxpar.cluster.preemption import PREEMPTED_EXIT_CODE

# processes timed against each other: one at a time, on one pytest-xdist worker (`--dist loadgroup`)
pytestmark = [pytest.mark.serial, pytest.mark.xdist_group("processes"), pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = launch.cpu_env(os.environ, 8)  # the inherited XLA_FLAGS (e.g. --xla_cpu_max_isa) kept
LAUNCH = [sys.executable, "-m", "jaxpar.launch", "--num_processes", "2", "--devices_per_process", "4", "--"]


def train_args(corpus, cache, workdir, steps, *extra):
    return [os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/shakespeare.py"),
            "--workdir", str(workdir), f"--config.data.sources={corpus}/*.txt", f"--config.data.cache_dir={cache}",
            "--config.model.layers=2", "--config.model.embed=32", "--config.model.mlp=64", "--config.model.seq_len=16",
            "--config.train.global_batch_size=8", "--config.train.microbatches=2", "--config.mesh.data=2",
            "--config.mesh.tensor=2", "--config.mesh.stage=2", f"--config.train.steps={steps}",
            "--config.checkpoint.every_steps=4", "--config.log.every_steps=1", "--config.eval.every_steps=100000",
            "--config.eval.batches=1", "--config.log.progress=False", *extra]


def run(args, processes, env=ONE):
    cmd = [sys.executable, *args] if processes == 1 else LAUNCH + args
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def assert_losses_equal(a, b, steps):
    for k in steps:  # float64 runs (LOSS_F64_RTOL)
        assert abs(a[k] - b[k]) <= LOSS_F64_RTOL * abs(b[k]), (k, a[k], b[k])


def saved_state(workdir, step):
    """The whole train state of checkpoint `step` (params, optimizer state, step, rng) on one device."""
    from jaxpar import data
    from jaxpar.state import runs
    from jaxpar.state.checkpoint import Checkpointer
    from jaxpar.train.optim import make_optimizer
    from jaxpar.train.step import init_state, model_config

    config = runs.read_config(workdir)
    vocab = max(int(config.model.vocab_size), data.load_tokenizer(os.path.join(workdir, "tokenizer")).vocab_size)
    cfg = model_config(config, vocab, int(config.mesh.tensor))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(lambda: init_state(cfg, make_optimizer(config), 0))
    with Checkpointer(workdir, 1, 1, async_save=False, read_only=True) as ckpt:
        state, _ = ckpt.restore(step, jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev),
                                                   shapes))
    return jax.device_get(state)


# the equivalence runs are float64 (helpers.F64_TOL: after optimizer steps only float64 is free of the CPU's
# summation order), in JAX's x64 mode
F64 = ["--config.train.param_dtype=float64", "--config.train.compute_dtype=float64"]
F64_ENV = dict(ONE, JAX_ENABLE_X64="1")


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """float64 runs at (2, 2, 2): 1 x 8 devices, steps 1-6, checkpoints 4 and 6; 2 x 4 devices, steps 1-4,
    checkpoint 4 (its own data cache)."""
    d = tmp_path_factory.mktemp("multihost")
    args = lambda name, steps, cache="cache1": train_args(corpus, d / cache, d / name, steps, *F64)  # noqa: E731
    one_out = run(args("one", 6), 1, F64_ENV)
    two_out = run(args("two", 4, "cache2"), 2, F64_ENV)
    return d, args, one_out, two_out


def test_two_processes_train_like_one(reference):
    d, _, _, out = reference
    with jax.enable_x64(True):  # params and Adam moments after 4 AdamW steps (helpers.assert_params_exact)
        two, one = (saved_state(d / name, 4) for name in ("two", "one"))
    assert_params_exact({k: two[k] for k in ("params", "opt_state")}, {k: one[k] for k in ("params", "opt_state")})
    assert_losses_equal(losses(d / "two"), losses(d / "one"), range(1, 5))
    # logs, metrics and TensorBoard come from process 0 only
    assert re.search(r"^\[rank 0\] jaxpar: mesh", out, re.M)
    assert not re.search(r"^\[rank 1\] (jaxpar: mesh|step)", out, re.M)
    assert sorted(losses(d / "two")) == [1, 2, 3, 4] and len(os.listdir(d / "two" / "tb")) == 1


def test_checkpoint_resumes_across_process_counts(reference):
    d, args, _, _ = reference
    shutil.copytree(d / "two", d / "two_to_one")  # written by 2 processes, resumed by 1
    assert "start step 4" in run(args("two_to_one", 6), 1, F64_ENV)
    shutil.copytree(d / "one", d / "one_to_two")  # written by 1 process (its step 4), resumed by 2
    shutil.rmtree(d / "one_to_two" / "checkpoints" / "6")
    assert "start step 4" in run(args("one_to_two", 6), 2, F64_ENV)
    for name in ("two_to_one", "one_to_two"):  # both continue the uninterrupted 1-process run
        assert_losses_equal(losses(d / name), losses(d / "one"), (5, 6))


def start_two(corpus, tmp_path, *extra, main=None):
    """2 processes training (endlessly) in tmp_path/run; each one's output in tmp_path/rank<i>.log. `main`: a
    script that runs train.py (bench/stuck_main.py)."""
    logs = [open(tmp_path / f"rank{i}.log", "w") for i in range(2)]
    args = train_args(corpus, tmp_path / "cache", tmp_path / "run", 100000, *extra)
    args = [main, *args] if main else args
    procs = launch.spawn(args, 2, 4, stdout=lambda r: logs[r])
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    # step 3 logged by process 0: process 1 then dispatched step 3 (its collectives), so it has timed step 2 (its
    # beat after logging step 2); at step 2 logged by process 0, process 1 may still be logging its step 2
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert all(p.poll() is None for p in procs), (tmp_path / "rank0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no step 3 within 240 s"
        time.sleep(0.1)
    return procs


def freeze_one(procs, tmp_path):
    """SIGSTOP process 1; -> (process 0's exit code, seconds it took, its log)."""
    procs[1].send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        rc = procs[0].wait(timeout=120)
    finally:
        procs[1].kill()
    return rc, time.monotonic() - t0, (tmp_path / "rank0.log").read_text()


def test_dead_process_is_reported_at_once_naming_the_step(corpus, tmp_path):
    """Default config (heartbeat timeout 60 s): the collective that loses its peer plus the peer's stopped heartbeat
    are certain evidence, so the survivor exits (code 3) within seconds, not after the whole timeout (it took 64 s)."""
    procs = start_two(corpus, tmp_path)
    procs[1].kill()
    t0 = time.monotonic()
    rc = procs[0].wait(timeout=120)
    elapsed = time.monotonic() - t0
    out = (tmp_path / "rank0.log").read_text()
    assert rc == PEER_LOST_EXIT_CODE, out[-3000:]
    # the certain evidence: a collective that lost its peer, or the peer's liveness port refusing (no collective
    # had failed yet), each with its heartbeat stopped
    assert re.search(r"process 1 is gone: (a collective lost its connection to it|its heartbeat stopped [\d.]+ s ago "
                     r"and its liveness port refuses connections) \(after step \d+\)", out), out[-3000:]
    # 3 heartbeats (1 s each) + 0.5 s of certainty, + the 2.5 s process 0 keeps the coordinator up
    assert elapsed < 15, elapsed


def test_sigterm_to_one_process_stops_both_at_the_same_step(corpus, tmp_path):
    """SIGTERM to process 1 alone: the flag, agreed on one step boundary late (no per-step host sync), stops both
    processes at the same step with one complete checkpoint, exit code 75 each."""
    procs = start_two(corpus, tmp_path)
    procs[1].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=180) for p in procs]
    outs = [(tmp_path / f"rank{i}.log").read_text() for i in range(2)]
    assert codes == [PREEMPTED_EXIT_CODE] * 2, outs[0][-2000:] + outs[1][-2000:]
    saved = [int(d) for d in os.listdir(tmp_path / "run" / "checkpoints") if d.isdigit()]
    stops = [int(re.search(r"checkpoint of step (\d+) saved", o).group(1)) for o in outs]
    assert stops[0] == stops[1] and stops[0] in saved, (stops, saved)


def test_frozen_process_stops_the_others_after_the_heartbeat_timeout(corpus, tmp_path):
    """A whole process frozen (SIGSTOP: no heartbeat, its connections open, so no collective error): the peer watch
    ends the job after dist.heartbeat_timeout_s, naming the process and the step."""
    timeout = 4
    procs = start_two(corpus, tmp_path, f"--config.dist.heartbeat_timeout_s={timeout}", "--config.dist.step_timeout_s=0")
    rc, elapsed, out = freeze_one(procs, tmp_path)
    assert rc == PEER_LOST_EXIT_CODE, out[-3000:]
    assert re.search(rf"process 1 sent no heartbeat for {timeout} s \(after step \d+\)", out), out[-3000:]
    # detection after the timeout (+ one 0.4 s poll), then process 0 keeps the coordinator up 1.3 s for the others;
    # JAX's own backstop (a C++ abort, no message) would come at 2 x 4 + 10 = 18 s
    assert elapsed < timeout + 5, elapsed


def test_stuck_main_thread_ends_the_job_by_default(corpus, tmp_path):
    """The main thread of process 1 blocks for good (SIGUSR1 in bench/stuck_main.py) while its heartbeat runs on:
    with the default config (dist.step_timeout_s auto: max(60 s, 20 x the slowest step)) every process exits
    (code 4) within 120 s, naming the step, instead of waiting in the collective forever."""
    procs = start_two(corpus, tmp_path, main=os.path.join(ROOT, "bench", "stuck_main.py"))
    procs[1].send_signal(signal.SIGUSR1)
    t0 = time.monotonic()
    try:
        rc = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:
            p.kill()
    elapsed = time.monotonic() - t0
    out = (tmp_path / "rank0.log").read_text() + (tmp_path / "rank1.log").read_text()
    assert rc == [STALLED_EXIT_CODE] * 2, out[-3000:]
    assert re.search(r"no training step finished within 60 s \(dist.step_timeout_s auto: max\(60 s, 20 x the "
                     r"slowest step [0-9.]+ s\)\): step \d+ (\(in its [a-z ]+\) )?has not finished", out), out[-3000:]
    assert 55 < elapsed < 120, elapsed


def test_stalled_process_trips_the_step_watchdog(corpus, tmp_path):
    procs = start_two(corpus, tmp_path, "--config.dist.step_timeout_s=5", "--config.dist.heartbeat_timeout_s=60")
    rc, elapsed, out = freeze_one(procs, tmp_path)  # alive (its connections stay open) but stuck
    assert rc == STALLED_EXIT_CODE, out[-3000:]
    last = max(losses(tmp_path / "run"))
    # the step after the last logged one, or the last logged one if process 1 froze in its checkpoint save (a step
    # ends when its save does)
    m = re.search(r"no training step finished within 5 s \(dist.step_timeout_s\): step (\d+)( \(in its ([a-z ]+)\))? "
                  r"has not finished", out)
    assert m, out[-3000:]
    assert int(m[1]) == (last if m[3] else last + 1), (m[0], last)  # evaluation and save come after the log
    # 5 s without a step, + one 1 s poll, + 2.5 s that process 0 keeps the coordinator up; measured 8.2 s
    assert elapsed < 5 + 1 + 2.5 + 3.5, elapsed


def test_two_processes_on_one_host_fetch_a_hub_name_once(corpus, tmp_path):
    """`data.sources=hfds:ORG/NAME` with two processes on one node (HF cache built here, offline): process 0
    resolves it (the only calls that may download), process 1 waits and then reads its host's cache
    (`local_files_only`); both train on it."""
    import hashlib

    cache, commit = tmp_path / "hf", "c0ffee" * 6 + "beef"
    snap = cache / "datasets--org--corpus" / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(corpus.glob("*.txt")):  # the corpus as a JSONL dataset (blobs linked from the snapshot)
        blob = cache / "datasets--org--corpus" / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_text(json.dumps({"text": f.read_text()}) + "\n")
        (snap / f"train-{f.stem}.jsonl").symlink_to(os.path.relpath(blob, snap))
    (cache / "datasets--org--corpus" / "refs").mkdir()
    (cache / "datasets--org--corpus" / "refs" / "main").write_text(commit)
    spy = tmp_path / "calls.jsonl"
    base = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", HUB_SPY_LOG=str(spy))
    args = train_args(corpus, tmp_path / "cache", tmp_path / "run", 2)
    args = [a if not a.startswith("--config.data.sources=") else "--config.data.sources=hfds:org/corpus" for a in args]
    port, procs = launch.free_port(), []
    for rank in range(2):  # one node for both (the launcher names one per process)
        env = dict(launch.process_env(base, rank, 2, 4, port), JAXPAR_NODE="host-a")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "hub_spy.py"), *args], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    calls = [json.loads(x) for x in spy.read_text().splitlines()]
    zero, one = ([c for c in calls if c["process"] == p] for p in (0, 1))
    assert zero and not any(c["local_files_only"] for c in zero), calls
    assert one and all(c["local_files_only"] for c in one), calls
    assert max(c["end"] for c in zero) <= min(c["start"] for c in one), calls
    assert sorted(losses(tmp_path / "run")) == [1, 2]
    assert json.loads((tmp_path / "run" / "hub.json").read_text()) == {"hfds:org/corpus": commit}
