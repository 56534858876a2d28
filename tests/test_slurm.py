"""jaxpar under a real SLURM: `munged`, `slurmctld` and `slurmd` started from a config written to a temporary directory
(a one-node cluster on this machine, as root; `.ci/run` installs Debian's `slurm-wlm` and `munge`), and
`scripts/slurm/train.sbatch` submitted as a user would, its `#SBATCH` lines overridden on the command line (one node,
2 tasks, no GPUs; 4 fake CPU devices per task). Nothing outside the temporary directory is changed; the daemons are
stopped at the end. If they cannot start, the tests fail saying why (never skipped in CI).

Cases: (a) `scancel --signal=TERM` mid-run: both tasks save the same step and exit 75, the script requeues, the
requeued run resumes and finishes with the uninterrupted run's losses; (b) one task killed with SIGKILL: the job
ends within the documented bound, naming the process, and SLURM records a failure; (c) SLURM's own time-limit
signal (`--time=2` with `--signal=TERM@70`, as the template sets its own) reaches the same save-and-requeue path;
(d) a GRPO run (rounds sampled, scored and trained by both tasks) logs what 1 process x 8 devices logs.

A requeued job waits out its job credential's lifetime before it starts again (120 s by default); the test's
cluster sets `AuthInfo=...,cred_expire=30`, so the module stays under ~3 minutes. (Moving the requeued job's start
time to now instead races slurmd, which still holds the revoked credential: "Job credential revoked".)"""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxpar import launch

# processes timed against each other: one at a time, on one pytest-xdist worker (`--dist loadgroup`)
pytestmark = [pytest.mark.serial, pytest.mark.xdist_group("processes"), pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(d: str, node: str) -> str:
    ctld, slurmd = free_port(), free_port()
    return f"""ClusterName=jaxpartest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock,cred_expire=30
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
ReturnToService=2
MpiDefault=none
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=10
MinJobAge=600
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=jaxpartest Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Cluster:
    """A one-node SLURM in directory `d`; `env` is what its clients (and the jobs) run with."""

    def __init__(self, d: str):
        missing = [c for c in DAEMONS if shutil.which(c) is None]
        if missing:
            pytest.fail(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge "
                        f"(.ci/run does)")
        if os.geteuid() != 0:
            pytest.fail("the SLURM daemons are started as root here; run the test as root (CI does)")
        self.d, self.node, self.procs = d, socket.gethostname().split(".")[0], []
        for sub in ("state", "spool", "jobs"):
            os.makedirs(os.path.join(d, sub))
        with open(os.path.join(d, "munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(os.path.join(d, "munge.key"), 0o400)
        with open(os.path.join(d, "slurm.conf"), "w") as f:
            f.write(slurm_conf(d, self.node))
        venv = os.path.dirname(sys.executable)
        self.env = dict(launch.cpu_env(os.environ, 4), SLURM_CONF=os.path.join(d, "slurm.conf"),
                        PATH=venv + os.pathsep + os.environ.get("PATH", ""))
        self.env.pop("SLURM_JOB_ID", None)

    def start(self):
        d = self.d
        subprocess.run(["munged", f"--key-file={d}/munge.key", f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
                        f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed", "--force"], check=True,
                       capture_output=True, timeout=30)
        conf = os.path.join(d, "slurm.conf")
        for cmd in (["slurmctld", "-D", "-f", conf], ["slurmd", "-D", "-f", conf, "-N", self.node]):
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed"):
                return
            time.sleep(0.5)
        logs = "".join(open(os.path.join(d, n)).read()[-1500:] for n in ("slurmctld.log", "slurmd.log")
                       if os.path.exists(os.path.join(d, n)))
        pytest.fail(f"the SLURM daemons did not bring node {self.node} up within 60 s: {logs}")

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self.d, "munged.pid")) as f:
                os.kill(int(f.read().strip()), signal.SIGTERM)

    def run(self, *cmd) -> str:
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (cmd, out.stderr)
        return out.stdout

    def job(self, job_id: int) -> dict:
        """`scontrol show job` as {key: value}."""
        text = self.run("scontrol", "show", "job", str(job_id), "-o")
        return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)

    def wait_state(self, job_id: int, states, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["JobState"] in states:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {info['JobState']} after {timeout:g} s (wanted {states}); "
                             f"{self.output(job_id)[-3000:]}")

    def output(self, job_id: int) -> str:
        path = os.path.join(self.d, "jobs", f"{job_id}.out")
        return open(path).read() if os.path.exists(path) else ""

    def submit(self, corpus, name: str, steps: int, *sbatch) -> int:
        """`sbatch scripts/slurm/train.sbatch` on 1 node x 2 tasks, no GPUs, workdir d/name; -> the job id."""
        d = self.d
        train = [f"--config.data.sources={corpus}/*.txt", f"--config.data.cache_dir={d}/cache",
                 "--config.model.layers=2", "--config.model.embed=32", "--config.model.mlp=64",
                 "--config.model.seq_len=16", "--config.train.global_batch_size=8", "--config.mesh.data=8",
                 f"--config.train.steps={steps}", "--config.checkpoint.every_steps=100000",
                 "--config.log.every_steps=1", "--config.eval.every_steps=100000", "--config.eval.batches=1"]
        return self.submit_config(os.path.join(ROOT, "configs/shakespeare.py"), f"{d}/{name}", name, *train,
                                  sbatch=sbatch)

    def submit_config(self, config: str, workdir: str, name: str, *train, sbatch=()) -> int:
        """`sbatch scripts/slurm/train.sbatch CONFIG --workdir=WORKDIR TRAIN...` on 1 node x 2 tasks; -> the job id."""
        out = self.run("sbatch", "--parsable", f"--job-name={name}", "--partition=jaxpartest", "--nodes=1",
                       "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
                       f"--output={self.d}/jobs/%j.out", *sbatch, os.path.join(ROOT, "scripts/slurm/train.sbatch"),
                       config, f"--workdir={workdir}", *train)
        return int(out.strip().split(";")[0])

    def wait_requeued(self, job_id: int, timeout: float = 60) -> None:
        """Until SLURM has requeued the job (a restart counted; it then waits out its credential lifetime, 30 s here,
        `cred_expire`, before it starts again)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if int(info.get("Restarts", 0)) >= 1:
                return
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} was not requeued: {info}; {self.output(job_id)[-3000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("slurm")))
    c.start()
    try:
        yield c
    finally:
        c.stop()


def losses(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def wait_for_step(workdir, step: int, timeout: float, cluster, job_id):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(losses(workdir), default=0) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout:g} s: {cluster.output(job_id)[-3000:]}")


STEPS = 100


def test_preempted_job_saves_requeues_and_resumes_with_the_uninterrupted_losses(cluster, corpus):
    ref = cluster.submit(corpus, "uninterrupted", STEPS)
    job = cluster.submit(corpus, "preempted", STEPS)
    cluster.wait_state(ref, ("COMPLETED",), 240)
    wd = os.path.join(cluster.d, "preempted")
    wait_for_step(wd, 5, 120, cluster, job)
    cluster.run("scancel", "--signal=TERM", str(job))  # to the job's steps (the tasks), not the batch shell
    cluster.wait_requeued(job)
    cluster.wait_state(job, ("COMPLETED",), 240)
    out = cluster.output(job)
    saved = re.findall(r"checkpoint of step (\d+) saved", out)
    assert len(saved) >= 1 and "requeueing job" in out, out[-3000:]
    assert re.search(rf"start step {saved[0]}\b", out), out[-3000:]
    print(f"job {job}: preempted at step {saved[0]}, requeued, resumed and finished {STEPS} steps")
    a, b = losses(os.path.join(cluster.d, "uninterrupted")), losses(wd)
    assert sorted(b) == sorted(a) == list(range(1, STEPS + 1))
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-6 * abs(a[k]), (k, a[k], b[k])


def test_a_killed_task_ends_the_job_naming_it_and_slurm_records_a_failure(cluster, corpus):
    job = cluster.submit(corpus, "killed", 100000)
    wd = os.path.join(cluster.d, "killed")
    wait_for_step(wd, 3, 120, cluster, job)
    victim = next(pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _task_of(pid, job) == "1")
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    info = cluster.wait_state(job, ("FAILED",), 60)
    took = time.monotonic() - t0
    out = cluster.output(job)
    print(f"killed task 1 of job {job}: SLURM recorded {info['JobState']} {info['ExitCode']} after {took:.1f} s")
    assert took < 30, took  # the documented bound: a killed peer is named within seconds (docs/multihost.md)
    assert re.search(r"process 1 (is gone|sent no heartbeat)", out), out[-3000:]
    assert info["ExitCode"] != "0:0", info


def _task_of(pid: int, job: int) -> str | None:
    """SLURM_PROCID of a train.py process of `job`, or None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"train.py" not in f.read():
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    if env.get(b"SLURM_JOB_ID") != str(job).encode():
        return None
    return env.get(b"SLURM_PROCID", b"").decode() or None


def test_the_time_limit_signal_saves_and_requeues(cluster, corpus):
    """`--time=2 --signal=TERM@70`: SLURM signals the tasks about 70 s before the two-minute limit (it checks every
    30 s or so, and may signal up to a minute early); they save and exit 75, and the script requeues the job."""
    job = cluster.submit(corpus, "timelimit", 100000, "--time=2", "--signal=TERM@70")
    cluster.wait_requeued(job, timeout=120)
    out = cluster.output(job)
    assert re.search(r"preempted \(SIGTERM\): checkpoint of step \d+ saved", out), out[-3000:]
    assert "requeueing job" in out, out[-3000:]
    cluster.run("scancel", str(job))


def test_a_grpo_run_killed_inside_a_round_resumes_under_slurm_as_one_process_runs_it(cluster, grpo_reference):
    """`helpers.grpo_material`'s 1-process GRPO run (float64) killed after step 3's checkpoint, inside round 1, and
    resumed with `train.sbatch` on 1 node x 2 tasks x 4 devices: it starts at step 3 from the round's kept batch and
    logs step 4's metrics as the uninterrupted run (rewards exactly; the held-out greedy completions sampled and
    scored on both tasks), the round's completions once. (The 2-process run from step 0, through the launcher:
    `tests/test_multihost_engine.py`.)"""
    from rl_runs import assert_same_grpo_run, cut_grpo_run, grpo_completions, grpo_metrics

    root, _ = grpo_reference
    workdir = os.path.join(cluster.d, "grpo")
    cut_grpo_run(root / "one", workdir)
    job = cluster.submit_config(str(root / "config.py"), workdir, "grpo", "--config.eval.tasks=",
                                sbatch=("--export=ALL,JAX_ENABLE_X64=1",))  # (lm-eval's task: the launcher's test)
    cluster.wait_state(job, ("COMPLETED",), 240)
    assert "start step 3" in cluster.output(job)
    no_tasks = lambda run: {s: {k: v for k, v in m.items() if not k.startswith("eval/")}  # noqa: E731
                            for s, m in grpo_metrics(run).items()}
    assert_same_grpo_run(no_tasks(workdir), no_tasks(root / "one"))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "process"} for r in rows]  # noqa: E731
    assert strip(grpo_completions(workdir)) == strip(grpo_completions(root / "one"))
