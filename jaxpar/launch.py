"""Local launcher: N processes on this machine, as N hosts would run, for tests and for trying multi-host.

    python -m jaxpar.launch --num_processes 2 --devices_per_process 4 -- train.py --config configs/shakespeare.py

Each process gets the coordinator address, the process count and its id (JAXPAR_* variables, `jaxpar.cluster.distributed`),
`JAXPAR_NODE=local-<i>` (each process counts as its own node, so `data` spans processes as it spans nodes), and on
CPU (`--platform cpu`, the default) `devices_per_process` fake CPU devices and gloo collectives; on `gpu` each
process drives GPUs [i*K, (i+1)*K). Every output line is prefixed with `[rank i]` (gloo's per-device connection
lines are left out). SIGTERM is forwarded to every process, and so is SIGINT, as SIGTERM (Ctrl-C: every process
saves at the next step and exits 75; a second Ctrl-C kills them). The first process to exit non-zero (other than
the preemption code 75) starts a grace period (`--grace_s`), after which the rest are killed. Returns 0 when all
succeed, else the first non-zero exit code (128 + signal for a killed process).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

PREEMPTED = 75  # cluster.preemption.PREEMPTED_EXIT_CODE (not imported: this module must not import JAX)
_GLOO_CHATTER = re.compile(r"is connected to \d+ peer ranks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(base: dict, devices: int) -> dict:
    """`base` with `devices` fake CPU devices: the inherited XLA_FLAGS kept (e.g. `--xla_cpu_max_isa`), only the
    device count replaced."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", base.get("XLA_FLAGS", "")).split()
    return dict(base, JAX_PLATFORMS="cpu",
                XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]))


def process_env(base: dict, rank: int, num_processes: int, devices_per_process: int, port: int,
                platform: str = "cpu") -> dict:
    """The environment of local process `rank`."""
    env = dict(base, JAXPAR_NUM_PROCESSES=str(num_processes), JAXPAR_NODE=f"local-{rank}", PYTHONUNBUFFERED="1")
    if num_processes > 1:  # one process takes no coordinator or id (the start refuses the mix)
        env.update(JAXPAR_COORDINATOR=f"127.0.0.1:{port}", JAXPAR_PROCESS_ID=str(rank))
    if platform == "cpu":
        env = dict(cpu_env(env, devices_per_process), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    else:
        k = devices_per_process
        env["JAXPAR_LOCAL_DEVICE_IDS"] = ",".join(str(i) for i in range(rank * k, (rank + 1) * k))
    return env


def command(cmd: list[str]) -> list[str]:
    """`train.py ...` and `-m module ...` run with this Python; anything else as given."""
    return [sys.executable, *cmd] if cmd and (cmd[0].endswith(".py") or cmd[0] == "-m") else list(cmd)


def spawn(cmd: list[str], num_processes: int, devices_per_process: int, port: int | None = None,
          platform: str = "cpu", stdout=subprocess.PIPE) -> list[subprocess.Popen]:
    """Start the processes (each in its own session, so a terminal's Ctrl-C reaches only the launcher).
    `stdout`: PIPE, or a function rank -> file for each process's merged stdout and stderr."""
    port = port or free_port()
    procs = []
    for rank in range(num_processes):
        out = stdout(rank) if callable(stdout) else stdout
        procs.append(subprocess.Popen(command(cmd), env=process_env(os.environ, rank, num_processes,
                                                                    devices_per_process, port, platform),
                                      stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return procs


def _code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def supervise(procs: list[subprocess.Popen], grace_s: float = 30.0, say=print) -> int:
    """Wait for every process; after the first failure wait `grace_s` for the others, then kill them."""
    first, deadline = None, None
    while any(p.poll() is None for p in procs):
        for rank, p in enumerate(procs):
            rc = p.poll()
            if rc not in (None, 0) and first is None:
                first = _code(rc)
                if rc != PREEMPTED:
                    deadline = time.monotonic() + grace_s
                    say(f"[launch] process {rank} exited with code {first}; the others get {grace_s:g} s to stop")
        if deadline is not None and time.monotonic() > deadline:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    say(f"[launch] killing process {rank} (still running {grace_s:g} s after the first failure)")
                    p.kill()
            deadline = None
        time.sleep(0.1)
    codes = [_code(p.returncode) for p in procs]
    return first if first is not None else max(codes)


def _relay(rank: int, pipe, lock: threading.Lock) -> None:
    for line in pipe:
        if _GLOO_CHATTER.search(line):  # gloo: a line per device per new communicator (at times interleaved)
            continue
        with lock:
            sys.stdout.write(f"[rank {rank}] {line}")
            sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m jaxpar.launch [options] -- train.py [train.py flags]", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m jaxpar.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=4)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    parser.add_argument("--grace_s", type=float, default=30.0, help="after a failure, seconds before killing the rest")
    args = parser.parse_args(argv[:split])
    if args.num_processes < 1 or args.devices_per_process < 1 or not argv[split + 1:]:
        parser.error("need num_processes >= 1, devices_per_process >= 1 and a command after --")
    procs, interrupts = [], []

    def forward(signum, frame):  # Ctrl-C: SIGTERM (save at the next step, exit 75); a second one: SIGKILL
        interrupts.extend([signum] if signum == signal.SIGINT else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL if len(interrupts) > 1 else signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):  # before any process starts
        signal.signal(sig, forward)
    procs += spawn(argv[split + 1:], args.num_processes, args.devices_per_process, args.port or None, args.platform)
    lock = threading.Lock()
    relays = [threading.Thread(target=_relay, args=(r, p.stdout, lock), daemon=True) for r, p in enumerate(procs)]
    for t in relays:
        t.start()
    code = supervise(procs, args.grace_s, say=lambda m: print(m, file=sys.stderr, flush=True))
    for t in relays:
        t.join(5.0)
    return code


if __name__ == "__main__":
    sys.exit(main())
