"""The whole loop on a tiny corpus: resume continues the same run; bad input fails before compile, writing nothing."""
import json
import os

import pytest

from helpers import run_config
from jaxpar.train import step as step_mod
from jaxpar import trainer
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
