"""A full disk during a save, on a real filesystem: the checkpoint directory is a tmpfs the test mounts (as root, as
CI runs), filled so that the next save cannot fit. The save fails with one message naming the directory and the bytes
needed; the last complete checkpoint stays listed and restorable; the asynchronous save's failure reaches the
training loop and the job exits non-zero without a traceback; a rerun after space is freed resumes from it."""
import os
import shutil
import subprocess

import pytest

from jaxpar import launch
from jaxpar.state import runs
from jaxpar.state.checkpoint import Checkpointer
from helpers import command

# processes timed against each other: one at a time, on one pytest-xdist worker (`--dist loadgroup`)
pytestmark = [pytest.mark.serial, pytest.mark.xdist_group("processes"), pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def small_disk(tmp_path):
    """tmp_path/run/checkpoints as its own 8 MB tmpfs; (mount point, resize(bytes)); unmounted after the test."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    point = tmp_path / "run" / "checkpoints"
    point.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(point)], check=True)
    resize = lambda size: subprocess.run(["mount", "-o", f"remount,size={size}", str(point)], check=True)  # noqa: E731
    try:
        yield point, resize
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def train(corpus, tmp_path, steps):
    cmd = command(corpus, tmp_path, steps) + ["--config.checkpoint.every_steps=2"]
    return subprocess.run(cmd, env=launch.cpu_env(os.environ, 8), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_full_disk_during_a_save_keeps_the_last_checkpoint_and_the_rerun_resumes(corpus, tmp_path, small_disk):
    point, resize = small_disk
    first = train(corpus, tmp_path, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    used = shutil.disk_usage(point).used
    resize(used + 64 * 1024)  # step 2's checkpoint and 64 KB: step 4's cannot fit

    full = train(corpus, tmp_path, 6)
    errors = [line for line in full.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, full.stderr[-3000:]
    last = errors[0]
    print(last)  # what the user sees (after Orbax's one-line log records of the same failure)
    assert full.returncode == 1, full.stderr[-3000:]
    assert last.startswith(f"error: checkpoint save of step 4 failed: no space left on the device of {point}: "), last
    assert "bytes free, and a checkpoint of this train state needs about" in last
    assert "the last complete checkpoint, step 2, is kept and restorable" in last
    assert "Traceback" not in full.stderr and "Traceback" not in full.stdout
    with Checkpointer(str(tmp_path / "run"), 1, 1, async_save=False, read_only=True) as ckpt:
        assert ckpt.all_steps() == [2]
    assert runs.load_run(str(tmp_path / "run")).step == 2  # restorable

    resize("8m")  # space freed
    again = train(corpus, tmp_path, 6)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "start step 2" in again.stdout + again.stderr
    with Checkpointer(str(tmp_path / "run"), 1, 1, async_save=False, read_only=True) as ckpt:
        assert ckpt.latest_step() == 6
