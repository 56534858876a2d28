"""SIGTERM to a training process: it saves a complete checkpoint at the next step boundary, exits with the
documented code, and the same command resumes there."""
import json
import os
import signal
import subprocess
import time

import pytest

from helpers import command
from jaxpar import launch
from jaxpar.cluster.preemption import PREEMPTED_EXIT_CODE

# processes timed against each other: one at a time, on one pytest-xdist worker (`--dist loadgroup`)
pytestmark = [pytest.mark.serial, pytest.mark.xdist_group("processes"), pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def logged_steps(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def test_sigterm_saves_at_step_boundary_and_exits_with_code(corpus, tmp_path):
    env = launch.cpu_env(os.environ, 8)
    proc = subprocess.Popen(command(corpus, tmp_path, 100000), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while len(logged_steps(metrics)) < 3:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "training never logged 3 steps"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, out
    saved = [int(d) for d in os.listdir(tmp_path / "run" / "checkpoints") if d.isdigit()]
    assert len(saved) == 1 and saved[0] >= 3, saved
    k = saved[0]
    assert f"checkpoint of step {k} saved" in out
    assert max(logged_steps(metrics)) == k  # it stopped at the boundary where it saved
    # the same command, asked for two more steps, resumes at k
    res = subprocess.run(command(corpus, tmp_path, k + 2), env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"start step {k}" in res.stdout
    assert logged_steps(metrics)[-2:] == [k + 1, k + 2]
