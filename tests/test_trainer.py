"""The whole loop on a tiny corpus: resume continues the same run; bad input fails before compile, writing nothing."""
import json
import os
import signal
import types

import jax
import numpy as np
import pytest

from helpers import run_config
from jaxpar import compiled, data, trainer
from jaxpar.analysis import throughput
from jaxpar.cluster import preemption
from jaxpar.train.feed import TokenFeed
from jaxpar.train import step as step_mod
from jaxpar.validate import validate
from jaxpar.config import ConfigError
from jaxpar.data import DataError


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_stop_and_rerun_resumes_the_same_run(corpus, tmp_path):
    full = str(tmp_path / "full")
    trainer.run(run_config(corpus, tmp_path, **{"mesh.data": 4, "mesh.tensor": 2}), full)
    part = str(tmp_path / "part")
    trainer.run(run_config(corpus, tmp_path, **{"mesh.data": 4, "mesh.tensor": 2, "train.steps": 3}), part)
    assert sorted(losses(part)) == [1, 2, 3]
    trainer.run(run_config(corpus, tmp_path, **{"mesh.data": 4, "mesh.tensor": 2}), part)  # same command again
    a, b = losses(full), losses(part)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    assert [a[k] for k in range(1, 7)] == [b[k] for k in range(1, 7)]  # bitwise: same layout, same CPU
    assert os.path.isfile(os.path.join(part, "config.json"))
    assert os.path.isdir(os.path.join(part, "tokenizer"))


def test_resume_with_another_model_is_refused_and_touches_nothing(corpus, tmp_path):
    wd = str(tmp_path / "run")
    trainer.run(run_config(corpus, tmp_path, **{"train.steps": 3}), wd)
    before = sorted(os.listdir(os.path.join(wd, "checkpoints")))
    with pytest.raises(ConfigError, match="model.embed"):
        trainer.run(run_config(corpus, tmp_path, **{"model.embed": 64}), wd)
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == before


@pytest.fixture
def no_compile(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("reached the compile stage")
    monkeypatch.setattr(trainer, "steps_for", boom)
    monkeypatch.setattr(step_mod, "build", boom)


@pytest.mark.parametrize("over,match", [
    ({"train.global_batch_size": 12, "train.microbatches": 2}, r"global_batch_size=12 .* mesh.data=8 x train.microbatches=2"),
    ({"mesh.tensor": 3, "mesh.data": -1}, r"does not divide the 8 devices"),
    ({"mesh.data": 2, "mesh.tensor": 2}, r"data=2 x tensor=2 x stage=1 = 4 devices, but 8"),
    ({"mesh.data": 1, "mesh.tensor": 8, "model.heads": 4}, r"model.heads=4 is not divisible by mesh.tensor=8"),
    ({"mesh.data": 2, "mesh.tensor": 4, "model.mlp": 66}, r"MLP width 66 is not divisible by mesh.tensor=4"),
    ({"mesh.data": 2, "mesh.stage": 4, "train.microbatches": 6, "train.global_batch_size": 24,
      "pipeline.schedule": "1f1b", "pipeline.virtual_stages": 2}, r"microbatches=6 is not a multiple of mesh.stage=4"),
    ({"mesh.data": 4, "mesh.stage": 2, "train.microbatches": 2, "pipeline.schedule": "zb_h1",
      "pipeline.virtual_stages": 2}, r"virtual_stages=2 with pipeline.schedule='zb_h1'"),
])
def test_bad_layout_fails_before_compile_and_writes_nothing(corpus, tmp_path, no_compile, over, match):
    wd = tmp_path / "run"
    with pytest.raises(ConfigError, match=match):
        trainer.run(run_config(corpus, tmp_path, **over), str(wd))
    assert not wd.exists()


def test_missing_data_fails_before_compile_and_writes_nothing(tmp_path, no_compile):
    c = run_config(tmp_path / "nowhere", tmp_path)
    with pytest.raises(DataError):
        trainer.run(c, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_dry_run_writes_compile_report_without_training(corpus, tmp_path):
    wd = tmp_path / "dry"
    rep = trainer.dry_run(run_config(corpus, tmp_path, **{"mesh.data": 4, "mesh.tensor": 2,
                                                           "train.microbatches": 2, "optim.zero_stage": 1}), str(wd))
    on_disk = json.loads((wd / "compile_report.json").read_text())
    assert on_disk["layout"] == rep["layout"] and rep["layout"]["zero_stage"] == 1
    assert set(rep["state_bytes"]) >= {"params", "opt_state", "grad_buffer"}
    assert rep["memory"]["peak"] > 0 and rep["flops_per_step"] > 0
    assert "all-reduce" in rep["collectives_by_kind"]
    assert not (wd / "checkpoints").exists() and not (wd / "metrics.jsonl").exists()


def test_a_start_validates_once_keeps_every_config_and_a_finished_run_says_so(corpus, tmp_path, monkeypatch, capsys):
    """One validation per start; each start's config kept in starts/ (config.json the latest); a resume of a
    finished run says that train.steps is reached and writes nothing; the first step (it compiles) is not timed, and
    an fp32 run logs no loss scale."""
    calls = []
    counted = lambda config, n: calls.append(n) or validate(config, n)  # noqa: E731
    monkeypatch.setattr(trainer, "validate", counted)
    monkeypatch.setattr(compiled, "validate", counted)
    wd = tmp_path / "run"
    trainer.run(run_config(corpus, tmp_path, **{"train.steps": 2, "mesh.data": 8}), str(wd))
    assert len(calls) == 1
    rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert "tokens_per_s" not in rows[0] and rows[1]["tokens_per_s"] > 0 and rows[1]["tflops_per_device"] > 0
    assert not any("loss_scale" in r for r in rows)
    trainer.run(run_config(corpus, tmp_path, **{"train.steps": 3, "mesh.data": 4, "mesh.tensor": 2}), str(wd))
    starts = sorted(p.name for p in (wd / "starts").iterdir())
    assert starts == ["000-step-0.json", "001-step-2.json"]
    first, latest = (json.loads((wd / "starts" / s).read_text()) for s in starts)
    assert first["mesh"]["tensor"] == 1 and latest["mesh"]["tensor"] == 2
    assert json.loads((wd / "config.json").read_text()) == latest
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in wd.rglob("*")}
    assert trainer.run(run_config(corpus, tmp_path, **{"train.steps": 3, "mesh.data": 8}), str(wd)) == {}
    assert f"nothing to run: {wd} holds the checkpoint of step 3 and train.steps=3 is reached" in \
        capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in wd.rglob("*")} == before


def test_the_preemption_check_reads_each_agreement_one_boundary_late():
    """With several processes the stop flag is agreed on by an all-reduce queued at each step boundary and read at
    the next: no boundary waits for (reads) the agreement it just queued, so the host keeps queueing steps."""
    queued = []

    class Agreement:  # stands in for the unread device array `any_process` returns
        def __init__(self, flag):
            self.flag, self.read = flag, False
            queued.append(self)

        def __bool__(self):
            self.read = True
            return self.flag

    watch = preemption.PreemptionWatch(agree=Agreement)
    try:
        assert not watch.reached()
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.requested and not watch.reached()  # the signal's boundary reads the agreement before it
        assert watch.reached()  # one boundary later: every process reads the same agreement
        assert [a.read for a in queued] == [True, True, False]  # the newest is never read where it was queued
    finally:
        watch.close()
    assert bool(preemption.any_process(True)) and not bool(preemption.any_process(False))  # the real one, on 8 devices


def test_throughput_leaves_out_saves():
    now = [0.0]
    clock = throughput.Interval(lambda: now[0])
    for _ in range(4):
        now[0] += 1.0
        clock.add(100)
    with clock.pause():
        now[0] += 10.0  # a checkpoint save
    assert clock.rates() == {"tokens_per_s": 100.0, "step_time_s": 1.0}
    clock.restart()
    assert clock.rates() == {}
    assert data.real_tokens({"tokens": np.zeros((2, 5)), "segments": np.array([[0, 0, 1, -1, -1]] * 2)}) == 6


def test_validation_without_weighted_tokens_is_an_error(tmp_path):
    """A mean over no token is no loss: an error naming the fix, never a val_loss of 0.0."""
    feed = types.SimpleNamespace(config=run_config(tmp_path, tmp_path), eval_step=lambda params, batch, *ref: (0.0, 0.0),
                                 batch_at=lambda source, i: None, val_data=types.SimpleNamespace(val_batch=None))
    with pytest.raises(DataError, match=r"validation batches \(eval.batches\) hold no token the loss counts"):
        TokenFeed.evaluate(feed, {"params": {}})


def test_the_host_stays_a_bounded_number_of_steps_ahead(corpus, tmp_path, monkeypatch):
    """Between logs the host waits for the step AHEAD steps back (XLA:CPU deadlocked in a collective with about a
    hundred steps queued), and for no other but the first (its compile is no training time): with n steps
    dispatched, it waits on a loss while AHEAD newer steps are queued, once per step from the (AHEAD + 1)-th on.
    Bounded from below (never further ahead) and from above (a host that waited for each step it just dispatched
    would run nothing ahead)."""
    waited, dispatched = [], []
    real, real_batch = jax.block_until_ready, TokenFeed.to_global
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append((x, len(dispatched))) or real(x))
    monkeypatch.setattr(TokenFeed, "to_global", lambda self, rows: dispatched.append(1) or real_batch(self, rows))
    c = run_config(corpus, tmp_path, **{"train.steps": 8, "mesh.data": 8})
    c.log.update(every_steps=100)
    trainer.run(c, str(tmp_path / "run"))
    at = [n for w, n in waited if getattr(w, "shape", None) == ()]  # steps dispatched when the host waited on a loss
    assert trainer.AHEAD >= 1 and at == [1] + list(range(trainer.AHEAD + 1, 9)), at
    assert len({id(w) for w, _ in waited if getattr(w, "shape", None) == ()}) == 8 - trainer.AHEAD  # distinct losses
