"""Multi-process (multi-host) start-up: who this process is, who coordinates, which local devices it drives.

`resolve(env, ...)` is pure (no JAX) and decides, in this order:
  1. explicit: flags `--coordinator/--num_processes/--process_id`, else env `JAXPAR_COORDINATOR` ("host:port"),
     `JAXPAR_NUM_PROCESSES`, `JAXPAR_PROCESS_ID` (`JAXPAR_LOCAL_DEVICE_IDS` "0,1", `JAXPAR_NODE` optional);
  2. SLURM, when started by `srun`: process id/count from SLURM_PROCID / SLURM_STEP_NUM_TASKS (or SLURM_NTASKS),
     coordinator = first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) : 20000 + SLURM_JOB_ID % 10000
     (`JAXPAR_COORDINATOR_PORT` overrides), local GPUs = this task's share of the GPUs SLURM gave the node;
  3. otherwise one process.
`initialize(plan, ...)` then calls `jax.distributed.initialize` with every value explicit (JAX's own SLURM detection,
which gives every process one GPU, is switched off), before anything touches a device, and starts the peer watch
(`jaxpar.cluster.watchdog`). Errors raise `DistributedError`, naming the variables and the fix.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys

from jaxpar.cluster import watchdog

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS, ENV_NODE, ENV_PORT = "JAXPAR_LOCAL_DEVICE_IDS", "JAXPAR_NODE", "JAXPAR_COORDINATOR_PORT"


class DistributedError(ValueError):
    """The environment or flags do not describe a runnable multi-process job; the message names what and the fix."""


@dataclasses.dataclass(frozen=True)
class ProcessPlan:
    """How this process joins the job. `local_device_ids` None: every device the process sees (e.g. all GPUs of
    the node, or the one SLURM bound to the task). `node`: processes with the same node share fast links; the mesh
    keeps `tensor` (and `stage` when it fits) within a node."""
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None  # "host:port" of process 0's coordination service
    local_device_ids: tuple[int, ...] | None = None
    node: str = ""
    source: str = "single"  # single | flags | env | slurm


def _int(name: str, value, lo: int = 0) -> int:
    try:
        v = int(str(value).strip())
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer.") from None
    if v < lo:
        raise DistributedError(f"{name}={v} must be >= {lo}.")
    return v


def _ids(name: str, value: str) -> tuple[int, ...]:
    return tuple(_int(name, x) for x in value.split(",") if x.strip())


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: "gpu[003-004,007],cpu1" -> "gpu003" (each bracket gives its first entry).

    Raises:
      DistributedError: empty or unbalanced list.
    """
    spec, depth = "", 0
    for ch in nodelist.strip():
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or (ch == "," and depth == 0):
            break
        spec += ch
    if not spec or depth != 0:
        raise DistributedError(f"cannot read the first host of the SLURM node list {nodelist!r}.")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], spec)


def _tasks_per_node(key: str, spec: str, node_id: int, env) -> int:
    """Tasks on node `node_id` from SLURM's compressed form "8(x2),4" (= 8, 8, 4) in variable `key`.

    Raises:
      DistributedError: `spec` is not in that form, or lists fewer nodes than `node_id` needs (naming both)."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise DistributedError(f"{key}={spec!r} is not SLURM's tasks-per-node form (e.g. '8(x2),4'); unset it "
                                   f"or set SLURM_NTASKS_PER_NODE.")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node_id >= len(counts):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        raise DistributedError(
            f"inconsistent SLURM environment: SLURM_NODEID={node_id}, but {key}={spec!r} lists {len(counts)} "
            f"node(s) (ids 0-{len(counts) - 1})" + (f"; node list {nodelist!r}" if nodelist else "")
            + ". Start the job with srun inside one allocation (mixing variables of two jobs or steps gives this).")
    return counts[node_id]


def resolve(env, coordinator: str | None = None, num_processes: int | None = None,
            process_id: int | None = None) -> ProcessPlan:
    """The `ProcessPlan` for this process from flags (arguments) and `env` (a mapping like `os.environ`). Pure: no JAX.

    Raises:
      DistributedError: an incomplete or inconsistent explicit setting or SLURM environment.
    """
    explicit = {"coordinator": coordinator or env.get(ENV_COORDINATOR),
                "num_processes": num_processes if num_processes is not None else env.get(ENV_NUM_PROCESSES),
                "process_id": process_id if process_id is not None else env.get(ENV_PROCESS_ID)}
    ids = _ids(ENV_LOCAL_DEVICE_IDS, env[ENV_LOCAL_DEVICE_IDS]) if env.get(ENV_LOCAL_DEVICE_IDS) else None
    if any(v not in (None, "") for v in explicit.values()):
        source = "flags" if (coordinator or num_processes is not None or process_id is not None) else "env"
        n = _int("num_processes", explicit["num_processes"], 1) if explicit["num_processes"] not in (None, "") else None
        if n == 1:
            given = [f"--{k}={v}" for k, v in explicit.items() if k != "num_processes" and v not in (None, "")]
            if given:
                raise DistributedError(f"num_processes=1 with {' and '.join(given)} ({source}): one process needs "
                                       f"no coordinator or process id; drop them, or set num_processes to the "
                                       f"number of processes.")
            return ProcessPlan(local_device_ids=ids, node=env.get(ENV_NODE) or socket.gethostname(), source=source)
        missing = [f"--{k} (or {e})" for (k, v), e in zip(explicit.items(), (ENV_COORDINATOR, ENV_NUM_PROCESSES,
                                                                            ENV_PROCESS_ID)) if v in (None, "")]
        if missing:
            raise DistributedError("a multi-process run needs the coordinator address, the number of processes and "
                                   "this process's id; missing: " + ", ".join(missing) + ".")
        pid = _int("process_id", explicit["process_id"])
        if pid >= n:
            raise DistributedError(f"process_id={pid} must be < num_processes={n}.")
        return ProcessPlan(n, pid, _address(explicit["coordinator"]), ids, env.get(ENV_NODE) or socket.gethostname(), source)
    return _slurm(env, ids)


def _address(addr: str) -> str:
    host, _, port = str(addr).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"coordinator address {addr!r}: expected host:port (port 1-65535).")
    return f"{host}:{port}"


def _slurm(env, ids) -> ProcessPlan:
    in_step = any(k in env for k in ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"))
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if not in_step:
        if ntasks and _int("SLURM_NTASKS", ntasks, 1) > 1:
            raise DistributedError(
                f"this SLURM allocation has SLURM_NTASKS={ntasks} tasks, but this process was not started by srun "
                f"(no SLURM_STEP_* variables), so its peers will never start: run `srun python train.py ...` "
                f"(see scripts/slurm/train.sbatch), or pass --num_processes=1 to train in this process alone.")
        return ProcessPlan()  # no SLURM, or an allocation's shell (salloc / the batch script): one process
    need = {"SLURM_STEP_NUM_TASKS or SLURM_NTASKS": ntasks, "SLURM_PROCID": env.get("SLURM_PROCID"),
            "SLURM_LOCALID": env.get("SLURM_LOCALID"),
            "SLURM_STEP_NODELIST or SLURM_JOB_NODELIST": env.get("SLURM_STEP_NODELIST") or env.get(
                "SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
            "SLURM_JOB_ID (or JAXPAR_COORDINATOR_PORT)": env.get("SLURM_JOB_ID") or env.get(ENV_PORT)}
    missing = [k for k, v in need.items() if not v]
    if missing:
        raise DistributedError("incomplete SLURM environment (started by srun, but missing " + ", ".join(missing)
                               + "); launch with srun from an sbatch/salloc allocation, or set JAXPAR_COORDINATOR, "
                               "JAXPAR_NUM_PROCESSES and JAXPAR_PROCESS_ID explicitly.")
    n, pid = _int("SLURM_NTASKS", ntasks, 1), _int("SLURM_PROCID", env["SLURM_PROCID"])
    if pid >= n:
        raise DistributedError(f"SLURM_PROCID={pid} must be < the number of tasks {n}.")
    node = env.get("SLURMD_NODENAME") or (f"node{env['SLURM_NODEID']}" if env.get("SLURM_NODEID") else
                                          socket.gethostname())
    if n == 1:
        return ProcessPlan(local_device_ids=ids, node=node, source="slurm")
    port = _int(ENV_PORT, env[ENV_PORT], 1) if env.get(ENV_PORT) else 20000 + _int("SLURM_JOB_ID",
                                                                                 env["SLURM_JOB_ID"]) % 10000
    coordinator = _address(f"{first_host(need['SLURM_STEP_NODELIST or SLURM_JOB_NODELIST'])}:{port}")
    if ids is None:
        ids = _slurm_local_devices(env, n)
    return ProcessPlan(n, pid, coordinator, ids, node, "slurm")


def _slurm_local_devices(env, ntasks: int) -> tuple[int, ...] | None:
    """This task's GPUs: all the node's when it runs one task there (or SLURM bound GPUs to the task), else an
    equal share of the visible ones, by SLURM_LOCALID. Ids index the devices the process sees (CUDA renumbers
    CUDA_VISIBLE_DEVICES from 0)."""
    local = _int("SLURM_LOCALID", env["SLURM_LOCALID"])
    node_id = _int("SLURM_NODEID", env.get("SLURM_NODEID", "0"))
    per_node = None
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(key):
            per_node = _tasks_per_node(key, env[key], node_id, env)
            break
    if per_node is None and env.get("SLURM_NTASKS_PER_NODE"):
        per_node = _int("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS_PER_NODE"], 1)
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if per_node is None and nodes and ntasks % int(nodes) == 0:
        per_node = ntasks // int(nodes)
    if per_node is None:
        raise DistributedError(f"cannot tell how many tasks run on this node: SLURM_STEP_TASKS_PER_NODE, "
                               f"SLURM_NTASKS_PER_NODE and SLURM_STEP_NUM_NODES are unset (or the {ntasks} tasks do "
                               f"not split evenly over {nodes} nodes); set SLURM_NTASKS_PER_NODE.")
    if local >= per_node:
        raise DistributedError(f"SLURM_LOCALID={local} must be < the {per_node} tasks on this node.")
    if per_node == 1:
        return None
    if env.get("CUDA_VISIBLE_DEVICES", "").strip():
        visible = tuple(range(len(env["CUDA_VISIBLE_DEVICES"].split(","))))
    elif env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"):
        visible = _ids("SLURM_STEP_GPUS", env.get("SLURM_STEP_GPUS") or env["SLURM_JOB_GPUS"])
    else:
        return (local,)  # no GPU list: one device per task, by local rank (JAX's convention)
    bound = env.get("SLURM_GPUS_PER_TASK", "").rpartition(":")[2]
    if len(visible) == 1 or (bound.isdigit() and len(visible) == int(bound)):
        return None  # SLURM bound this task's GPUs (--gpus-per-task / --gpu-bind): it sees only its own
    if len(visible) % per_node:
        raise DistributedError(f"{len(visible)} GPUs visible on this node for {per_node} tasks: not an equal share; "
                               f"use --ntasks-per-node dividing the GPUs per node, or --gpus-per-task.")
    k = len(visible) // per_node
    return visible[local * k:(local + 1) * k]


_NODES: dict[int, str] | None = None  # process index -> node name, once initialized


def process_nodes() -> dict[int, str] | None:
    """Node name of every process (set by `initialize`); None when this module did not initialize JAX."""
    return _NODES


def initialize(plan: ProcessPlan, heartbeat_timeout_s: float = 60, init_timeout_s: float = 300) -> None:
    """Join the job: `jax.distributed.initialize` (CPU collectives: gloo), then exchange node names and start the
    peer watch: a process that sends no heartbeat for `heartbeat_timeout_s` makes the others exit with a message
    (JAX's own heartbeat, which aborts from C++, is set to 2x + 10 s as a backstop). No-op for one process.

    Raises:
      DistributedError: the coordinator was not reachable within `init_timeout_s`. (A peer that never joins makes
        JAX abort from C++ after `init_timeout_s`, with its message.)
    """
    global _NODES
    if plan.num_processes == 1:
        return
    import jax
    from jax._src import distributed as jax_distributed  # the coordination client: key-value store, barriers

    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):  # CPU processes need one; gloo needs no MPI
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if plan.process_id != 0:  # JAX aborts from C++ when it cannot connect: find out here first
        wait_for_coordinator(plan, init_timeout_s)
    try:
        jax.distributed.initialize(
            plan.coordinator, plan.num_processes, plan.process_id,
            local_device_ids=list(plan.local_device_ids) if plan.local_device_ids is not None else None,
            cluster_detection_method="deactivate", initialization_timeout=int(init_timeout_s),
            heartbeat_timeout_seconds=int(2 * heartbeat_timeout_s + 10), shutdown_timeout_seconds=int(init_timeout_s))
        client = jax_distributed.global_state.client
        client.key_value_set(f"jaxpar/node/{plan.process_id}", plan.node)
        client.wait_at_barrier("jaxpar/nodes", int(init_timeout_s * 1000))
        _NODES = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get("jaxpar/node/")}
    except Exception as e:  # XlaRuntimeError: DEADLINE_EXCEEDED, UNAVAILABLE, ...
        raise DistributedError(f"process {plan.process_id} of {plan.num_processes} could not join the job at "
                               f"coordinator {plan.coordinator} within {init_timeout_s:.0f} s ({plan.source}): "
                               f"{str(e).splitlines()[0]}. Is process 0 running, and is the port free and "
                               f"reachable from every node?") from e
    watchdog.start_peers(client, plan.process_id, plan.num_processes, float(heartbeat_timeout_s), plan.coordinator)


def join(env=os.environ) -> ProcessPlan:
    """A command line's start (`python -m jaxpar.generate`, `python -m jaxpar.evaluate`): the job the environment
    describes (`resolve`: SLURM's variables or the launcher's JAXPAR_*), joined with the default timeouts."""
    plan = resolve(env)
    initialize(plan)
    return plan


def wait_for_coordinator(plan: ProcessPlan, timeout_s: float) -> None:
    """Return once `plan.coordinator` accepts TCP connections (process 0 has started its coordination service).

    Raises:
      DistributedError: the host is unknown, or nothing listens there within `timeout_s` seconds.
    """
    import time

    host, port = plan.coordinator.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            return
        except socket.gaierror as e:
            raise DistributedError(f"coordinator host {host!r} ({plan.source}) is unknown here: {e}.") from None
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"process {plan.process_id} of {plan.num_processes}: nothing answers at coordinator "
                    f"{plan.coordinator} ({plan.source}) after {timeout_s:g} s (dist.init_timeout_s): {e}. Is "
                    f"process 0 running on that host (it starts the coordinator), and is the port free and "
                    f"reachable?") from None
            time.sleep(0.5)


def process_0_first(fn, name: str):
    """`fn()` on process 0, then a barrier, then on the others (which then find its result in a shared cache; a
    node-local cache is built once per node, under its file lock). One process: just `fn()`."""
    import jax

    if jax.process_count() == 1:
        return fn()
    out = fn() if jax.process_index() == 0 else None
    barrier(name)
    return out if jax.process_index() == 0 else fn()


def from_process_0(fn, name: str):
    """`fn()` on process 0; its result (JSON) given to every other process, which waits for it (the coordination
    service's key-value store). One process: just `fn()`."""
    import jax

    if jax.process_count() == 1:
        return fn()
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if jax.process_index() == 0:
        out = fn()
        client.key_value_set(name, json.dumps(out))
        return out
    return json.loads(client.blocking_key_value_get(name, 24 * 3600 * 1000))


def first_on_node() -> bool:
    """Whether this process has the lowest index of the processes on its node (True for one process)."""
    import jax

    nodes = process_nodes()
    if not nodes:
        return True
    me = jax.process_index()
    return me == min(p for p, n in nodes.items() if n == nodes[me])


def barrier(name: str) -> None:
    """Every process waits here until all arrive (the coordination service's barrier; no device computation). A
    dead peer is reported by the peer watch. No-op for one process."""
    import jax

    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed

        jax_distributed.global_state.client.wait_at_barrier(name, 24 * 3600 * 1000)


def stop_all(code: int, message: str) -> None:
    """Print `message` to stderr and exit with `code`; with several processes, make every other process exit with
    it too (within a second or two) instead of waiting at its next collective."""
    print(message, file=sys.stderr, flush=True)
    if watchdog.peers_running():
        watchdog.abort(message, code)  # never returns
    sys.exit(code)


def fail_all(error: BaseException) -> None:
    """With several processes: print `error`'s traceback and make every process exit (code 1) with its message.
    One process: return (the caller re-raises)."""
    if watchdog.peers_running():
        import traceback

        await_lost_peer(error)
        traceback.print_exception(error)
        stop_all(1, f"{type(error).__name__}: {error}")


def await_lost_peer(error: BaseException) -> None:
    """With several processes, when `error` is a collective that lost its peer (in a step, or in a checkpoint save's
    own collectives): let the peer watch name the process that is gone, or take the code a stuck peer posted (the
    step watchdog's 4), before this process reports `error` as its own failure."""
    if watchdog.peers_running() and any(m in str(error) for m in LOST_PEER_MARKS):
        watchdog.await_verdict(f"a collective failed ({type(error).__name__}: {str(error)[:200]})")


# What a collective's error says when the process on the other end is gone (gloo on CPU, NCCL/gRPC elsewhere)
LOST_PEER_MARKS = ("Connection closed by peer", "Connection reset by peer", "Gloo", "NCCL", "UNAVAILABLE",
                   "DEADLINE_EXCEEDED")


def describe(plan: ProcessPlan) -> str:
    ids = "all" if plan.local_device_ids is None else ",".join(map(str, plan.local_device_ids))
    return (f"process {plan.process_id} of {plan.num_processes} ({plan.source}), coordinator {plan.coordinator}, "
            f"node {plan.node}, local device ids {ids}")


if __name__ == "__main__":  # print the plan this environment gives: `srun python -m jaxpar.cluster.distributed`
    print(describe(resolve(os.environ)))


