"""Multi-process start-up without a cluster: synthetic SLURM and explicit environments -> the process id, count,
coordinator and local devices (or a clear error); the node-aware device order; the step watchdog; the launcher's
supervision. Fast: no JAX process group is started here (tests/test_multihost.py does that)."""
import collections
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxpar import launch
from jaxpar.config import ConfigError
from jaxpar.cluster.distributed import DistributedError, ProcessPlan, first_host, resolve, wait_for_coordinator
from jaxpar.parallel.mesh import node_order
from jaxpar.cluster.watchdog import STALLED_EXIT_CODE

# processes timed against each other: one at a time, on one pytest-xdist worker (`--dist loadgroup`)
pytestmark = [pytest.mark.serial, pytest.mark.xdist_group("processes")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def srun_env(ntasks, procid, localid, nodeid, nodelist, tasks_per_node, nnodes, **extra):
    """What `srun` puts in a task's environment (the variables resolve reads)."""
    env = dict(SLURM_JOB_ID="123456", SLURM_STEP_ID="0", SLURM_NTASKS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks),
               SLURM_PROCID=str(procid), SLURM_LOCALID=str(localid), SLURM_NODEID=str(nodeid),
               SLURM_STEP_NODELIST=nodelist, SLURM_JOB_NODELIST=nodelist, SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
               SLURM_STEP_NUM_NODES=str(nnodes), SLURMD_NODENAME=f"gpu{nodeid:03d}")
    env.update(extra)
    return env


PORT = 20000 + 123456 % 10000


def test_slurm_one_task_per_node_gets_all_its_gpus():
    env = srun_env(2, 1, 0, 1, "gpu[000-001]", "1(x2)", 2, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert resolve(env) == ProcessPlan(2, 1, f"gpu000:{PORT}", None, "gpu001", "slurm")  # None: every visible GPU


def test_slurm_one_task_per_gpu_gets_its_own():
    cvd = "0,1,2,3,4,5,6,7"
    plans = [resolve(srun_env(8, i, i, 0, "gpu000", "8", 1, CUDA_VISIBLE_DEVICES=cvd)) for i in range(8)]
    assert [p.local_device_ids for p in plans] == [(i,) for i in range(8)]
    assert {(p.num_processes, p.coordinator) for p in plans} == {(8, f"gpu000:{PORT}")}
    assert [p.process_id for p in plans] == list(range(8))
    # SLURM bound one GPU to each task (--gpus-per-task=1): it sees only its own, as device 0
    assert resolve(srun_env(8, 5, 5, 0, "gpu000", "8", 1, CUDA_VISIBLE_DEVICES="5")).local_device_ids is None
    # no CUDA_VISIBLE_DEVICES, the step's GPUs listed by SLURM (physical ids): this task's share of them
    assert resolve(srun_env(4, 1, 1, 0, "gpu000", "4", 1, SLURM_STEP_GPUS="4,5,6,7")).local_device_ids == (5,)


def test_slurm_several_nodes_several_gpus_per_task():
    env = srun_env(8, 6, 2, 1, "node[003,007-008]", "4(x2)", 2, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    plan = resolve(env)
    assert (plan.num_processes, plan.process_id, plan.coordinator) == (8, 6, f"node003:{PORT}")
    assert plan.local_device_ids == (4, 5)  # local task 2 of 4: GPUs 4, 5 of the node's 8
    assert resolve(dict(env, JAXPAR_COORDINATOR_PORT="7777")).coordinator == "node003:7777"
    # uneven tasks per node, read from SLURM's compressed form
    assert resolve(srun_env(5, 4, 1, 1, "n[1-2]", "3,2", 2, CUDA_VISIBLE_DEVICES="0,1")).local_device_ids == (1,)


def test_slurm_partial_or_wrong_environments_are_clear_errors_or_one_process():
    env = srun_env(8, 3, 3, 0, "gpu000", "8", 1)
    for missing in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST"):
        partial = {k: v for k, v in env.items() if k != missing and not (missing == "SLURM_STEP_NODELIST"
                                                                          and k == "SLURM_JOB_NODELIST")}
        with pytest.raises(DistributedError, match=missing):
            resolve(partial)
    with pytest.raises(DistributedError, match="not started by srun"):  # the batch script itself, no srun
        resolve(dict(SLURM_JOB_ID="1", SLURM_NTASKS="16", SLURM_PROCID="0", SLURM_JOB_NODELIST="gpu[000-001]"))
    assert resolve(dict(SLURM_JOB_ID="1", SLURM_JOB_NODELIST="gpu000")) == ProcessPlan()  # an salloc shell: one process
    assert resolve({}) == ProcessPlan()
    with pytest.raises(DistributedError, match="6 GPUs visible on this node for 4 tasks"):
        resolve(srun_env(4, 0, 0, 0, "gpu000", "4", 1, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5"))
    with pytest.raises(DistributedError, match="SLURM_PROCID=9 must be < the number of tasks 8"):
        resolve(dict(env, SLURM_PROCID="9"))


def test_explicit_flags_and_environment():
    env = dict(JAXPAR_COORDINATOR="10.0.0.1:1234", JAXPAR_NUM_PROCESSES="4", JAXPAR_PROCESS_ID="3",
               JAXPAR_NODE="n1", SLURM_JOB_ID="1", SLURM_STEP_ID="0")  # explicit settings win over SLURM
    assert resolve(env) == ProcessPlan(4, 3, "10.0.0.1:1234", None, "n1", "env")
    assert resolve(env, process_id=2).process_id == 2
    assert resolve({}, "h:1", 2, 0).source == "flags"
    with pytest.raises(DistributedError, match=r"missing: --process_id \(or JAXPAR_PROCESS_ID\)"):
        resolve({}, "h:1", 2)
    with pytest.raises(DistributedError, match="process_id=2 must be < num_processes=2"):
        resolve({}, "h:1", 2, 2)
    with pytest.raises(DistributedError, match="expected host:port"):
        resolve({}, "h", 2, 0)
    assert resolve({}, num_processes=1).num_processes == 1
    for coordinator, pid, said in (("h:1", None, "--coordinator=h:1"), (None, 0, "--process_id=0"),
                                   ("h:1", 3, "--coordinator=h:1 and --process_id=3")):
        with pytest.raises(DistributedError, match=f"num_processes=1 with {said} \\(flags\\): one process needs no"):
            resolve({}, coordinator, 1, pid)
    with pytest.raises(DistributedError, match=r"num_processes=1 with --coordinator=h:2 \(env\)"):
        resolve({"JAXPAR_COORDINATOR": "h:2", "JAXPAR_NUM_PROCESSES": "1"})


def test_unreachable_coordinator_is_a_clear_error():
    port = launch.free_port()
    with pytest.raises(DistributedError, match=f"nothing answers at coordinator 127.0.0.1:{port}"):
        wait_for_coordinator(ProcessPlan(2, 1, f"127.0.0.1:{port}"), 1.0)
    with socket.socket() as s:  # something listening: returns
        s.bind(("127.0.0.1", 0))
        s.listen()
        wait_for_coordinator(ProcessPlan(2, 1, f"127.0.0.1:{s.getsockname()[1]}"), 1.0)


def test_first_host_of_a_node_list():
    assert first_host("node001") == "node001"
    assert first_host("node001,node002") == "node001"
    assert first_host("node[001-004]") == "node001"
    assert first_host("gpu[003,007-009],cpu1") == "gpu003"
    assert first_host("rack[1-2]-gpu[03-04]") == "rack1-gpu03"
    with pytest.raises(DistributedError):
        first_host("node[001")


Dev = collections.namedtuple("Dev", "id process_index")


def test_mesh_keeps_tensor_within_a_node():
    # 2 nodes x 8 GPUs, one process per GPU, processes numbered node by node; device ids interleaved on purpose
    devs = [Dev(100 + p, p) for p in range(16)][::-1]
    nodes = {p: f"n{p // 8}" for p in range(16)}
    order = node_order(devs, tensor=8, nodes=nodes)
    assert [d.process_index for d in order] == list(range(16))  # reshape (data=2, stage=1, tensor=8): 1 node each
    with pytest.raises(ConfigError, match="mesh.tensor=16 does not divide the 8 devices of a node"):
        node_order(devs, tensor=16, nodes=nodes)
    # one process per node with 4 devices: without node names each process is its own node
    devs = [Dev(4 * p + i, p) for p in (1, 0) for i in range(4)]
    assert [(d.process_index, d.id) for d in node_order(devs, 2)] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                                       (1, 4), (1, 5), (1, 6), (1, 7)]
    with pytest.raises(ConfigError, match="different numbers of devices"):
        node_order(devs[:-1], 1)


def test_step_watchdog_names_the_step():
    code = ("import time; from jaxpar.cluster import watchdog; watchdog.arm_steps(0.5); watchdog.beat(6); "
            "time.sleep(20)")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == STALLED_EXIT_CODE, res.stderr
    assert "no training step finished within 0.5 s (dist.step_timeout_s): step 7" in res.stderr
    assert time.monotonic() - t0 < 15


def test_launcher_returns_first_failure_and_kills_the_rest():
    procs = [subprocess.Popen([sys.executable, "-c", c]) for c in ("import time; time.sleep(60)", "exit(3)")]
    t0 = time.monotonic()
    assert launch.supervise(procs, grace_s=1, say=lambda m: None) == 3
    assert time.monotonic() - t0 < 20 and procs[0].returncode == -signal.SIGKILL


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_sigterm_and_ctrl_c_as_sigterm(sig):
    child = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); "
             "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar.launch", "--num_processes", "2", "--",
                             sys.executable, "-c", child],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    ready = [proc.stdout.readline() for _ in range(2)]
    assert sorted(ready) == ["[rank 0] ready\n", "[rank 1] ready\n"]
    proc.send_signal(sig)  # the children exit 75 on SIGTERM only
    assert proc.wait(timeout=30) == 75


def test_launcher_environment():
    env = launch.process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"}, 1, 2, 4, 999)
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    assert (env["JAXPAR_COORDINATOR"], env["JAXPAR_NUM_PROCESSES"], env["JAXPAR_PROCESS_ID"]) == ("127.0.0.1:999",
                                                                                                   "2", "1")
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert launch.process_env({}, 1, 2, 4, 999, "gpu")["JAXPAR_LOCAL_DEVICE_IDS"] == "4,5,6,7"
    one = launch.process_env({}, 0, 1, 8, 999)
    assert "JAXPAR_COORDINATOR" not in one and resolve(one).num_processes == 1
