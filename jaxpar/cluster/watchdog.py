"""Failure, never a hang: the peer watch (a dead process) and the step watchdog (a stuck one).

With several processes a dead peer leaves the others blocked in their next collective, and JAX's own heartbeat
ends them from C++ (an abort without a Python message). Here, instead:

- **peer watch** (`start_peers`, from `distributed.initialize`): every process bumps a counter in the coordination
  service's key-value store each `interval` (timeout / 10, within 0.2-1 s) and watches its ring neighbour's
  (process i watches i + 1 mod N, so a whole dead node is seen by the process before it). No change for
  `timeout` seconds, or no answer from the coordination service for as long: the watcher exits with a message.
- **step watchdog** (`arm_steps`, `beat`): no step boundary within the bound -> exit with a message naming the step
  (and whether it was in its evaluation or checkpoint save, `phase`). The bound is `dist.step_timeout_s`, or by
  default (-1, auto) max(`step_timeout_min_s`, `step_timeout_factor` x the slowest step so far, its evaluation and
  save left out), counted from the last step boundary, evaluation and save included; the first step (compilation) is not timed. 0 turns it off.
  A part of a step whose time is not the step's own (`part`: a GRPO round's sampling and scoring, which every
  `grpo.num_iterations` steps run, and long rollouts make longer than many steps) has a bound of its own under auto:
  max(`step_timeout_min_s`, `step_timeout_factor` x the slowest such part so far), its first (which compiles the
  engine) not timed; its time is left out of the step's. An explicit `dist.step_timeout_s` bounds the step with its
  parts.
- **a lost collective** (`await_verdict`): a collective that failed because a peer closed its connection is
  certain evidence once that peer's heartbeat has stopped too (no change for 3 beats): exit at once, naming the
  process and the step, instead of waiting out the whole heartbeat timeout.
- **a dead peer, seen directly**: each process listens on a TCP port of its own (published in the store). When the
  watched neighbour's heartbeat has not changed for 3 beats, the watcher connects to that port: refused means the
  process is gone (a killed process's port closes with it; a frozen one's kernel still accepts), so it exits at
  once, also when no collective has failed yet (e.g. the survivor waits in a new communicator's rendezvous).
- **abort**: whoever fails posts (code, message) under one key before exiting; every other process reads it within
  an interval and exits with the same code and the message, so no process waits on a dead collective. Process 0
  hosts the coordination service, so it lingers `2 * interval + 0.5` s before exiting, to let the others read it.

Exit codes: `PEER_LOST_EXIT_CODE` (3) a peer died or the coordinator vanished; `STALLED_EXIT_CODE` (4) no step within
`dist.step_timeout_s`; otherwise the code the failing process posted (1: an exception, 2: a config/data error).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time

PEER_LOST_EXIT_CODE = 3
STALLED_EXIT_CODE = 4
_ABORT = "jaxpar/abort"


class _Watch:
    def __init__(self):
        self.client, self.pid, self.n, self.timeout, self.coordinator = None, 0, 1, 0.0, None
        self.interval = 1.0
        self.step_timeout, self.step, self.beat_at = 0.0, None, None
        self.auto_min, self.auto_factor, self.slowest, self.phase = 60.0, 20.0, 0.0, "step"
        self.part, self.part_at, self.part_slowest = None, None, {}  # the running part, its start; {name: seconds}
        self.peer_value, self.peer_seen, self.peer_done, self.rpc_ok = None, 0.0, False, 0.0
        self.posted = None  # the abort another process posted: {"process", "code", "message"}
        self.stop = threading.Event()
        self.exiting = threading.Lock()
        self.checker = None
        self.port = None  # this process's liveness socket (listening; a thread accepts and closes each probe)
        self.peer_addr = None  # (host, port) of the watched neighbour's, once published


_W = _Watch()


def _say(text: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"jaxpar: process {_W.pid}: {text}\n")
    sys.stderr.flush()


def _try_get(key: str):
    try:
        return _W.client.key_value_try_get(key)
    except Exception as e:  # XlaRuntimeError; NOT_FOUND is an answer, anything else is not
        if "NOT_FOUND" in str(e):
            return None
        raise


def _pulse() -> None:
    k, neighbour = 0, (_W.pid + 1) % _W.n
    while not _W.stop.wait(_W.interval):
        k += 1
        try:
            _W.client.key_value_set(f"jaxpar/pulse/{_W.pid}", str(k), allow_overwrite=True)
            value, posted = _try_get(f"jaxpar/pulse/{neighbour}"), _try_get(_ABORT)
        except Exception:
            continue  # no answer: `rpc_ok` gets old and the checker reports it
        now = time.monotonic()
        _W.rpc_ok = now
        if _W.peer_addr is None:
            try:
                addr = _try_get(f"jaxpar/alive/{neighbour}")
                if addr:  # trusted only once it was reached: a firewall that rejects is no evidence of death
                    host, port = addr.rsplit(":", 1)
                    if _reached((host, int(port))):
                        _W.peer_addr = (host, int(port))
            except Exception:
                pass
        if value == "done":
            _W.peer_done = True
        elif value != _W.peer_value:
            _W.peer_value, _W.peer_seen = value, now
        if posted:
            _W.posted = json.loads(posted)


def _check() -> None:
    while not _W.stop.wait(_W.interval):
        now = time.monotonic()
        p = _W.posted
        if p and p["process"] != _W.pid and not _W.exiting.locked():
            _say(f"stopping: process {p['process']} failed: {p['message']}")
            _exit(int(p["code"]), linger=True)
        if _W.client is not None:
            if not _W.peer_done and now - _W.peer_seen > 3 * _W.interval + 0.5 and _refused(_W.peer_addr):
                fail(f"process {(_W.pid + 1) % _W.n} is gone: its heartbeat stopped {now - _W.peer_seen:.1f} s ago "
                     f"and its liveness port refuses connections ({_after()}).", PEER_LOST_EXIT_CODE)
            if not _W.peer_done and now - _W.peer_seen > _W.timeout:
                fail(f"process {(_W.pid + 1) % _W.n} sent no heartbeat for {_W.timeout:g} s ({_after()}): it died, "
                     f"hangs outside Python, or its host is unreachable (dist.heartbeat_timeout_s).",
                     PEER_LOST_EXIT_CODE)
            if now - _W.rpc_ok > _W.timeout:
                fail(f"no answer from the coordination service at {_W.coordinator} (hosted by process 0) for "
                     f"{_W.timeout:g} s ({_after()}): process 0 or its host is gone (dist.heartbeat_timeout_s).",
                     PEER_LOST_EXIT_CODE)
        said = _stalled(now)
        if said:
            fail(said, STALLED_EXIT_CODE)


def _stalled(now: float) -> str | None:
    """The step watchdog's message when the step (or, under auto, the part it is in) is past its bound, else None."""
    name, part_at = _W.part, _W.part_at
    if name is not None and part_at is not None and _W.step_timeout < 0:
        slowest = _W.part_slowest.get(name)
        bound = None if slowest is None else max(_W.auto_min, _W.auto_factor * slowest)
        if bound is None or now - part_at <= bound:
            return None
        return (f"the {name} of step {(_W.step or 0) + 1} has not finished {now - part_at:.0f} s after it began, past "
                f"its bound {bound:.3g} s (dist.step_timeout_s auto: max({_W.auto_min:g} s, {_W.auto_factor:g} x the "
                f"slowest {name} {slowest:.2f} s); it is stuck in this process or waits for a stuck one.")
    beat_at, bound = _W.beat_at, step_bound()
    if bound > 0 and beat_at is not None and now - beat_at > bound:
        return stall_message(now)
    return None


def stall_message(now: float) -> str:
    """What the step watchdog says when the step after `_W.step` has not finished within the bound."""
    if _W.step_timeout > 0:
        how = "dist.step_timeout_s"
    elif _W.slowest > 0:
        how = (f"dist.step_timeout_s auto: max({_W.auto_min:g} s, {_W.auto_factor:g} x the slowest step "
               f"{_W.slowest:.2f} s)")
    else:  # only the first, compiling step has finished, and it is not timed
        how = "dist.step_timeout_s auto: no step has been timed yet, so the minimum, dist.step_timeout_min_s"
    where = "" if _W.phase == "step" else f" (in its {_W.phase})"
    return (f"no training step finished within {step_bound():g} s ({how}): step {_W.step + 1}{where} has not "
            f"finished {now - _W.beat_at:.0f} s after step {_W.step} did; it is stuck in this process or waits for a "
            f"stuck one.")


def _listen(coordinator: str) -> None:
    """Open this process's liveness socket and publish its address (this host as the coordinator reaches it)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen(64)
    _W.port = sock

    def drain():  # accept and close each probe, so the backlog never fills while this process runs
        while True:
            try:
                sock.accept()[0].close()
            except OSError:
                return

    threading.Thread(target=drain, name="jaxpar-alive", daemon=True).start()
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # no packet is sent: it picks the outgoing address
        probe.connect((coordinator.rsplit(":", 1)[0] or "127.0.0.1", 9))
        host = probe.getsockname()[0]
        probe.close()
    except OSError:
        host = "127.0.0.1"
    _W.client.key_value_set(f"jaxpar/alive/{_W.pid}", f"{host}:{sock.getsockname()[1]}", allow_overwrite=True)


def _connect(addr) -> str:
    """"ok", "refused" or "unknown" (timeout, unreachable) for a TCP connect to `addr` (host, port)."""
    import socket

    try:
        socket.create_connection(addr, timeout=1.0).close()
        return "ok"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unknown"


def _reached(addr) -> bool:
    return _connect(addr) == "ok"


def _refused(addr) -> bool:
    """True only if a TCP connect to a port once reached is now refused: that process no longer exists."""
    return addr is not None and _connect(addr) == "refused"


def _after() -> str:
    return "before the first step finished" if _W.step is None else f"after step {_W.step}"


def _ensure_checker() -> None:
    if _W.checker is None:
        _W.checker = threading.Thread(target=_check, name="jaxpar-watchdog", daemon=True)
        _W.checker.start()


def start_peers(client, process_id: int, num_processes: int, timeout_s: float, coordinator: str) -> None:
    """Start the peer watch: `client` is JAX's coordination client (key-value store); `timeout_s` > 0 seconds."""
    _W.client, _W.pid, _W.n, _W.timeout, _W.coordinator = client, process_id, num_processes, timeout_s, coordinator
    _W.interval = min(1.0, max(0.2, timeout_s / 10))
    _W.peer_seen = _W.rpc_ok = time.monotonic()
    try:
        _listen(coordinator)
    except Exception:  # noqa: BLE001 - no liveness port: dead peers are then found by the heartbeat timeout
        pass
    threading.Thread(target=_pulse, name="jaxpar-pulse", daemon=True).start()
    _ensure_checker()
    atexit.register(stop)  # runs before JAX's own exit hook (atexit is last-in, first-out): quiet during shutdown


def peers_running() -> bool:
    return _W.client is not None and not _W.stop.is_set()


def await_verdict(what: str) -> None:
    """After a collective lost its connection to a peer: exit with PEER_LOST_EXIT_CODE as soon as a peer's heartbeat
    is seen stopped too (no change for 3 beats; or the coordination service gone as long), naming it and the step;
    otherwise wait up to the peer timeout (plus two polls) for the peer watch; return if every peer still answers."""
    _say(f"{what}; checking whether a process is gone (heartbeats; at most {_W.timeout:g} s, "
          f"dist.heartbeat_timeout_s).")
    t0 = time.monotonic()
    certain, deadline = 3 * _W.interval + 0.5, t0 + _W.timeout + 2 * _W.interval + 0.5
    seen, rpc_ok = {}, t0  # peer -> (last value, when it changed)
    after = _after()
    while time.monotonic() < deadline and not _W.exiting.locked():
        now = time.monotonic()
        try:
            values = {p: _try_get(f"jaxpar/pulse/{p}") for p in range(_W.n) if p != _W.pid}
            rpc_ok = now
        except Exception:  # noqa: BLE001 - no answer from the coordination service
            values = {}
            if now - rpc_ok > certain:
                fail(f"the coordination service at {_W.coordinator} (process 0) stopped answering right after a "
                     f"collective lost its connection ({after}): process 0 or its host is gone.", PEER_LOST_EXIT_CODE)
        for p, v in values.items():
            if v == "done":
                continue
            if p not in seen or seen[p][0] != v:
                seen[p] = (v, now)
            elif now - seen[p][1] > certain:
                fail(f"process {p} is gone: a collective lost its connection to it ({after}) and it sent no "
                     f"heartbeat for {now - seen[p][1]:.1f} s.", PEER_LOST_EXIT_CODE)
        time.sleep(_W.interval / 2)
    while _W.exiting.locked():  # the watch is exiting this process: let it
        time.sleep(0.1)


def arm_steps(timeout_s: float, min_s: float = 60.0, factor: float = 20.0) -> None:
    """Time every step after the next `beat`: within `timeout_s` seconds; -1 (auto): within max(`min_s`, `factor` x
    the slowest step timed so far); 0: off."""
    _W.step_timeout, _W.beat_at, _W.slowest = float(timeout_s), None, 0.0
    _W.auto_min, _W.auto_factor, _W.phase = float(min_s), float(factor), "step"
    if timeout_s != 0:
        _ensure_checker()


def step_bound() -> float:
    """Seconds the current step may take (0: not timed)."""
    if _W.step_timeout >= 0:
        return _W.step_timeout
    return max(_W.auto_min, _W.auto_factor * _W.slowest)


def _time_step(now: float) -> None:
    if _W.beat_at is not None and _W.phase == "step":  # the step itself: its evaluation and save are not counted
        _W.slowest = max(_W.slowest, now - _W.beat_at)


def beat(done: int) -> None:
    """A step boundary: `done` steps are finished; the next must finish within the bound (`step_bound`)."""
    now = time.monotonic()
    _time_step(now)
    _W.step, _W.beat_at, _W.phase = int(done), now, "step"


def phase(name: str) -> None:
    """Name what the current step is doing after its update ("evaluation", "checkpoint save") for the message; the
    time so far is the step's own (what the auto bound scales)."""
    _time_step(time.monotonic())
    _W.phase = name


@contextlib.contextmanager
def part(name: str):
    """A part of the current step timed on its own (module docstring): `with watchdog.part("sampling"): ...`."""
    _W.part, _W.part_at = name, time.monotonic()
    try:
        yield
    finally:
        took = time.monotonic() - _W.part_at
        _W.part_slowest[name] = max(_W.part_slowest.get(name, 0.0), took)
        if _W.beat_at is not None and _W.step_timeout < 0:  # (auto: the step's own time leaves it out)
            _W.beat_at += took
        _W.part, _W.part_at = None, None


def disarm() -> None:
    _W.step_timeout, _W.beat_at = 0.0, None
    _W.part, _W.part_at, _W.part_slowest = None, None, {}


def fail(message: str, code: int) -> None:
    """Print `message`, make every process exit with `code` (see the module doc), exit. Never returns."""
    if _W.exiting.acquire(blocking=False):
        _W.exiting.release()
        _say(f"error: {message}")
    abort(message, code)


def abort(message: str, code: int) -> None:
    """Post (code, message) for the other processes, then exit this one with `code`. Never returns."""
    _W.exiting.acquire()  # the first caller exits; any later one waits for that
    if _W.client is not None and not _W.stop.is_set():
        record = json.dumps({"process": _W.pid, "code": int(code), "message": message})
        t = threading.Thread(target=_post, args=(record,), daemon=True)
        t.start()
        t.join(2.0)  # the coordinator may be gone: do not wait on it
    _exit(code, linger=True)


def _post(value: str, key: str = _ABORT, overwrite: bool = False) -> None:
    try:  # the abort key: the first failure wins, later ones find it taken
        _W.client.key_value_set(key, value, allow_overwrite=overwrite)
    except Exception:
        pass


def _exit(code: int, linger: bool = False) -> None:
    if linger and _W.pid == 0 and _W.client is not None and not _W.stop.is_set():
        time.sleep(2 * _W.interval + 0.5)  # keep the coordination service up while the others read the abort
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop() -> None:
    """Stop watching (normal end of the process): tell the watcher of this process that it is done."""
    if _W.client is None or _W.stop.is_set():
        return
    _W.stop.set()
    t = threading.Thread(target=_post, args=("done", f"jaxpar/pulse/{_W.pid}", True), daemon=True)
    t.start()
    t.join(2.0)
