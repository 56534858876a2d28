"""Failure modes users report against the anchors (issue: hangs, a stuck resume, fp16 scale): each symptom as it
was described, through the real entry points. The multi-process ones (a stuck main thread, a dead peer) are in
tests/test_multihost.py."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import batch, pipe_config, place, steps_for, tiny_config
from jaxpar import launch, trainer
from jaxpar.train import loss_scale
from jaxpar.config import ConfigError
from jaxpar.validate import validate
from jaxpar.cluster.distributed import DistributedError, resolve
from jaxpar.cluster.watchdog import STALLED_EXIT_CODE
from helpers import command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 250



@pytest.mark.slow
def test_a_step_folder_without_its_commit_marker_is_set_aside_and_the_run_goes_on(corpus, tmp_path):
    """Run to step 4, remove checkpoints/4/commit_success.txt (a crash between the arrays and the marker, or an
    object store), rerun the same command: it resumes from step 2, retrains 3-4 and saves a complete step 4."""
    env = launch.cpu_env(os.environ, 8)
    cmd = command(corpus, tmp_path, 4) + ["--config.checkpoint.every_steps=2"]  # the last flag wins
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    ckpts = tmp_path / "run" / "checkpoints"
    os.remove(ckpts / "4" / "commit_success.txt")
    second = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "start step 2" in out and "is not a complete checkpoint" in out and "set aside" in out
    assert sorted(int(n) for n in os.listdir(ckpts) if n.isdigit()) == [2, 4]
    assert (ckpts / "4" / "commit_success.txt").exists() and (ckpts / "2" / "commit_success.txt").exists()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        logged = [json.loads(line)["step"] for line in f]
    assert logged == [1, 2, 3, 4, 3, 4]


def test_loss_scale_has_a_finite_ceiling_over_thousands_of_clean_steps():
    """window 1 from 2^16: without a ceiling the scale is inf after 112 growths and never comes back."""
    cfg = loss_scale.LossScaleConfig(window=1)
    assert cfg.max_scale == 2.0 ** 24

    def run(state, n, finite):
        return jax.lax.fori_loop(0, n, lambda i, s: loss_scale.update(s, finite, cfg)[0], state)

    state = jax.jit(run, static_argnums=(1, 2))(loss_scale.init(cfg), 5000, True)
    assert float(state.scale) == 2.0 ** 24 and int(state.good_steps) == 0
    after, _ = loss_scale.update(state, False, cfg)  # hysteresis 2 was refilled by the last growth: spends one
    after, _ = loss_scale.update(after, False, cfg)
    assert float(after.scale) == 2.0 ** 23
    # a state already at inf (written before the ceiling existed) recovers at its next update
    inf_state = state._replace(scale=jnp.asarray(jnp.inf, jnp.float32), hysteresis_left=jnp.asarray(1, jnp.int32))
    for finite in (True, False):
        assert np.isfinite(float(loss_scale.update(inf_state, finite, cfg)[0].scale))
    with pytest.raises(ValueError, match="max_scale"):
        loss_scale.LossScaleConfig(max_scale=float("inf"))
    with pytest.raises(ValueError, match="initial"):
        loss_scale.LossScaleConfig(initial=2.0 ** 30)


@pytest.mark.float16
def test_loss_scale_ceiling_in_the_real_fp16_step():
    """window 1 in the real fp16 step: the scale climbs to `train.loss_scale_max` and stays there over 300 clean
    steps (uncapped it would keep doubling until fp16 cotangents overflow, then oscillate)."""
    c = tiny_config(**{"mesh.data": 1, "train.compute_dtype": "float16", "train.loss_scale_window": 1,
                       "train.loss_scale_initial": 2.0 ** 8, "train.loss_scale_max": 2.0 ** 10, "optim.lr": 0.0})
    s = steps_for(c, VOCAB, jax.devices()[:1])
    state, b = s.init(0), place(s, batch(16, 16, VOCAB))
    scales, skipped = [], 0
    for _ in range(300):
        state, m = s.train(state, b)
        scales.append(m["loss_scale"])
        skipped += m["skipped"]
    scales = np.asarray(jax.device_get(scales))
    assert list(scales[:3]) == [2.0 ** 9, 2.0 ** 10, 2.0 ** 10] and (scales[2:] == 2.0 ** 10).all()
    assert int(skipped) == 0
    with pytest.raises(ConfigError, match="max_scale"):
        validate(tiny_config(**{"train.loss_scale_max": float("inf")}), 8)


def test_logged_lr_is_the_applied_one_after_a_skipped_step():
    """warmup 10, lr 1e-3, a NaN at call 3 (`train.nonfinite=skip`): the schedule counts applied updates (as
    DeepSpeed and Megatron on a skipped fp16 step), so calls 3, 4, 5 log 3e-4, 3e-4, 4e-4, and the run equals, bit
    for bit, the same run without the poisoned batch (whose calls 3, 4 apply 3e-4 and 4e-4)."""
    c = tiny_config(**{"mesh.data": 1, "train.nonfinite": "skip", "optim.warmup_steps": 10, "optim.decay_steps": 100,
                       "optim.lr": 1e-3})
    s = steps_for(c, VOCAB, jax.devices()[:1])
    clean = [dict(batch(16, 16, VOCAB, seed=i), mask=np.ones((16, 16), np.float32)) for i in range(4)]
    nan = dict(clean[0], mask=np.full((16, 16), np.nan, np.float32))

    def run(batches):
        state, lrs = s.init(0), []
        for b in batches:
            state, m = s.train(state, place(s, b))
            lrs.append(float(m["lr"]))
        return jax.device_get(state["params"]), lrs

    p_skip, lr_skip = run(clean[:2] + [nan] + clean[2:])
    p_ref, lr_ref = run(clean)
    np.testing.assert_allclose(lr_skip, [1e-4, 2e-4, 3e-4, 3e-4, 4e-4], rtol=1e-6)
    assert lr_skip[3:] == lr_ref[2:]
    for a, b in zip(jax.tree.leaves(p_skip), jax.tree.leaves(p_ref)):
        assert a.tobytes() == b.tobytes()


def test_named_steps_are_skipped_as_if_their_batches_were_not_there():
    """`train.skip_steps=(2, 4)` at (2, 1, 4) 1F1B: steps 2 and 4 log `skipped_named`, and the run equals, bit for bit,
    the same run without those batches (the schedule counts applied updates); a bad list is one clear error."""
    c = pipe_config(2, 1, 4, "1f1b", M=4, **{"optim.warmup_steps": 10, "optim.decay_steps": 100})
    clean = [batch(16, 16, VOCAB, seed=i) for i in range(5)]

    def run(config, batches):
        s = steps_for(config, VOCAB, jax.devices())
        state, named = s.init(0), []
        for b in batches:
            state, m = s.train(state, place(s, b))
            named.append(int(m["skipped_named"]))
        return jax.device_get(state["params"]), named

    skip = c.copy_and_resolve_references()
    skip.train.skip_steps = (2, 4)
    p_skip, named = run(skip, clean)
    p_ref, _ = run(c, [clean[0], clean[2], clean[4]])
    assert named == [0, 1, 0, 1, 0]
    for a, b in zip(jax.tree.leaves(p_skip), jax.tree.leaves(p_ref)):
        assert a.tobytes() == b.tobytes()
    skip.train.skip_steps = (0, 3)
    with pytest.raises(ConfigError, match=r"train.skip_steps=\(0, 3\) must be a tuple of step numbers >= 1"):
        validate(skip, 8)


def test_slurm_node_id_beyond_the_tasks_per_node_says_what_disagrees():
    env = dict(SLURM_JOB_ID="1", SLURM_STEP_ID="0", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="8", SLURM_PROCID="7",
               SLURM_LOCALID="3", SLURM_NODEID="2", SLURM_NODELIST="node[01-02]", SLURM_STEP_NODELIST="node[01-02]",
               SLURM_STEP_TASKS_PER_NODE="4(x2)")
    with pytest.raises(DistributedError) as e:
        resolve(env)
    msg = str(e.value)
    assert "SLURM_NODEID=2" in msg and "SLURM_STEP_TASKS_PER_NODE='4(x2)' lists 2 node(s)" in msg
    assert "node[01-02]" in msg and "unset" not in msg
    with pytest.raises(DistributedError, match="not SLURM's tasks-per-node form"):
        resolve(dict(env, SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="four"))


@pytest.mark.parametrize("over,hint", [
    ({"train.global_batch_size": 6, "mesh.data": 4, "mesh.tensor": 2}, "the nearest: 4 or 8"),
    ({"train.global_batch_size": 2, "mesh.data": 4, "mesh.tensor": 2}, "the nearest: 4)"),
    ({"mesh.data": 1, "mesh.tensor": 8, "model.heads": 12, "model.embed": 48}, "the nearest: 8 or 16"),
    ({"mesh.data": 2, "mesh.tensor": 4, "model.mlp": 66}, "the nearest: 64 or 68"),
    ({"mesh.data": 1, "mesh.tensor": 1, "mesh.stage": 8, "model.layers": 12, "train.microbatches": 8},
     "the nearest: 8 or 16"),
    ({"mesh.data": 2, "mesh.stage": 4, "train.microbatches": 6, "train.global_batch_size": 24,
      "pipeline.schedule": "1f1b", "pipeline.virtual_stages": 2}, "use 4 or 8"),
])
def test_divisibility_hints_give_the_nearest_sizes_on_both_sides(over, hint):
    with pytest.raises(ConfigError) as e:
        validate(tiny_config(**over), 8)
    assert hint in str(e.value)


def test_checkpoint_keep_0_fails_in_validate():
    with pytest.raises(ConfigError, match="checkpoint.keep=0"):
        validate(tiny_config(**{"checkpoint.keep": 0}), 8)


BAD_VALUES = [("optim.lr", -1e-3), ("optim.min_lr_ratio", 1.5), ("optim.weight_decay", -0.1), ("optim.b1", 1.0),
              ("optim.b2", -0.1), ("optim.eps", 0.0), ("optim.clip_norm", 0.0), ("model.dropout_embed", 1.0),
              ("model.dropout_resid", -0.5), ("model.vocab_size", -1), ("model.mlp", -64), ("model.heads", 0),
              ("train.seed", -1), ("train.global_batch_size", 0), ("eval.batches", 0), ("data.val_fraction", 0.0),
              ("data.bpe_vocab_size", 256), ("data.tokenizer", ""), ("log.profile_steps", (-1, 3)),
              ("pipeline.virtual_stages", 0)]


@pytest.mark.parametrize("key,value", BAD_VALUES)
def test_out_of_range_values_fail_in_validate_naming_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        validate(tiny_config(**{key: value}), 8)
    line = next(ln for ln in str(e.value).splitlines() if f"{key}=" in ln)
    assert repr(value) in line and "must be" in line


def test_an_out_of_range_value_fails_in_trainer_run_and_writes_nothing(corpus, tmp_path):
    from helpers import run_config

    wd = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"optim.b2=1.0 must be a number in \[0, 1\)"):
        trainer.run(run_config(corpus, tmp_path, **{"optim.b2": 1.0}), str(wd))
    assert not wd.exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("key,says", [("data.corpus", "it is now data.sources"),
                                      ("model.layer", "did you mean model.layers?"),
                                      ("optim.zero", "did you mean optim.zero_stage?")])
def test_an_unknown_config_key_is_refused_naming_the_key_it_meant(corpus, tmp_path, key, says):
    """A key `base_config()` does not have (a renamed one, a typo) is refused in `validate` with one line naming the
    key it meant, and `trainer.run` writes nothing; on the command line it is that line and exit 2, not
    ml_collections' traceback."""
    c = tiny_config(**{"mesh.data": 1})
    section, name = key.split(".")
    c[section][name] = 1  # ConfigDict takes a new field silently: before, the run trained on the default
    with pytest.raises(ConfigError, match=f"{key}: no such config key; {says}".replace("?", r"\?")):
        validate(c, 1)
    wd = tmp_path / "run"
    with pytest.raises(ConfigError, match="no such config key"):
        trainer.run(c, str(wd), devices=jax.devices()[:1])
    assert not wd.exists()
    res = subprocess.run(command(corpus, tmp_path, 1) + [f"--config.{key}=1"], env=launch.cpu_env(os.environ, 8),
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == f"error: --config.{key}: no such config key; {says} (every key: " \
                                                  f"docs/config.md)."


def test_a_slow_round_is_timed_on_its_own_and_a_stuck_one_is_named():
    """A GRPO step samples its round (`watchdog.part`): the first round compiles and is not timed, a later one may
    outlast the steps' bound (0.5 s) within factor x the slowest round, and its time is not the step's; a stuck one
    is named."""
    code = ("import sys, time; from jaxpar.cluster import watchdog; watchdog.arm_steps(-1, min_s=0.5, factor=5)\n"
            "for step, took in enumerate((0.4, 1.2, float(sys.argv[1]))):\n"
            "    with watchdog.part('sampling'):\n        time.sleep(took)\n"
            "    time.sleep(0.05); watchdog.beat(step + 1); print('step', step + 1, flush=True)\n")
    healthy = subprocess.run([sys.executable, "-c", code, "0.1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert healthy.returncode == 0 and healthy.stdout.split() == ["step", "1", "step", "2", "step", "3"], healthy
    stuck = subprocess.run([sys.executable, "-c", code, "30"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert stuck.returncode == STALLED_EXIT_CODE and "step 2" in stuck.stdout, stuck
    assert "the sampling of step 3 has not finished" in stuck.stderr and "5 x the slowest sampling 1.20 s" in \
        stuck.stderr, stuck.stderr


def test_a_stall_right_after_the_compiling_step_says_no_step_was_timed():
    """The first step compiles and is not timed: a stall in the second says so, not 'the slowest step 0.00 s'."""
    code = ("import time; from jaxpar.cluster import watchdog; watchdog.arm_steps(-1, min_s=0.5, factor=20); "
            "watchdog.beat(1); time.sleep(20)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == STALLED_EXIT_CODE, res.stderr
    assert "no step has been timed yet" in res.stderr and "0.00 s" not in res.stderr, res.stderr
    assert "within 0.5 s" in res.stderr and "step 2 has not finished" in res.stderr
