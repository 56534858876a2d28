"""Fast tests for jaxpar.analysis.throughput: FLOPs formula, peak table, MFU, JSONL/TensorBoard writer, console, profiler."""
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.analysis import throughput as m
from jaxpar.model import model_flops_per_token
from jaxpar.observe import monitor as mon

# GPT-2 small (124M): L=12, d=768, vocab 50257, T=1024, tied embedding counted once, no position embedding.
# Per block: 2 LayerNorms (2*2*768) + qkv (768*2304 + 2304) + attn out (768*768 + 768)
#            + fc (768*3072 + 3072) + mlp out (3072*768 + 768)                       = 7,087,872
# N = 12 * 7,087,872 + 50257*768 (wte) + 2*768 (final LN)                             = 123,653,376
# (+ 1024*768 position embedding = 124,439,808, GPT-2's published total)
GPT2_N = 123_653_376


def test_gpt2_param_count_by_hand():
    L, d, V, T = 12, 768, 50257, 1024
    per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert per_block == 7_087_872
    assert L * per_block + V * d + 2 * d == GPT2_N
    assert GPT2_N + T * d == 124_439_808


def test_model_flops_per_token_gpt2():
    # 6 N = 741,920,256; 12 L d T = 12*12*768*1024 = 113,246,208; sum = 855,166,464
    got = model_flops_per_token(GPT2_N, layers=12, embed=768, seq_len=1024)
    assert got == 855_166_464.0
    assert isinstance(got, float)


def test_model_flops_per_token_terms():
    assert model_flops_per_token(1000, 0, 0, 0) == 6000.0
    assert model_flops_per_token(0, 2, 3, 5) == 12 * 2 * 3 * 5
    with pytest.raises(ValueError):
        model_flops_per_token(-1, 1, 1, 1)


@pytest.mark.parametrize("kind,expected", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA A10", 125e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362.05e12),
    ("Tesla V100-SXM2-16GB", 125e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5", 459e12),
    ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12),
    ("tpu v5 LITE", 197e12),
])
def test_peak_flops_known(kind, expected):
    assert m.peak_flops(kind) == expected


@pytest.mark.parametrize("kind", ["cpu", "", "NVIDIA A10G", "TPU v4 lite", "TPU v3", "Some Future Chip"])
def test_peak_flops_unknown(kind):
    assert m.peak_flops(kind) is None


def test_tflops_and_mfu():
    fpt = model_flops_per_token(GPT2_N, 12, 768, 1024)
    tps = 400_000.0  # whole job, 4 devices
    assert m.tflops_per_device(tps, fpt, 4) == pytest.approx(tps * fpt / 4 / 1e12)
    assert m.mfu(tps, fpt, 4, 989e12) == pytest.approx(tps * fpt / (4 * 989e12))
    # exact arithmetic: 1e6 tok/s x 1e6 FLOPs/tok on 2 devices of 1e12 peak -> 0.5
    assert m.mfu(1e6, 1e6, 2, 1e12) == 0.5
    assert m.tflops_per_device(1e6, 1e6, 2) == 0.5
    assert m.mfu(tps, fpt, 4, None) is None
    assert m.mfu(tps, fpt, 4, 0.0) is None


def test_device_memory_bytes_cpu_or_dict():
    mem = m.device_memory_bytes()
    if mem is not None:  # an accelerator backend
        assert set(mem) <= {"bytes_in_use", "peak_bytes_in_use", "bytes_limit"}
        assert all(isinstance(v, int) for v in mem.values())


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_metrics_writer_jsonl_and_tb(tmp_path):
    w = mon.MetricsWriter(str(tmp_path), enabled=True)
    w.write(1, {"loss": 0.1 + 0.2, "lr": 3e-4, "mfu": None, "f32": np.float32(0.1), "arr": jnp.float32(2.5),
                "n": np.int64(7), "bad": float("nan")})
    # written and flushed before close: a crash would not lose it
    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 1
    w.write(2, {"loss": 1 / 3})
    w.close()
    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == 0.1 + 0.2 == 0.30000000000000004
    assert rows[0]["lr"] == 3e-4
    assert rows[0]["mfu"] is None and "mfu" in rows[0]
    assert rows[0]["f32"] == float(np.float32(0.1))
    assert rows[0]["arr"] == 2.5
    assert rows[0]["n"] == 7 and isinstance(rows[0]["n"], int)
    assert rows[0]["bad"] == "nan"
    assert rows[1]["loss"] == 1 / 3
    # strict JSON on every line (no bare NaN)
    with open(tmp_path / "metrics.jsonl") as f:
        for line in f:
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    tb = tmp_path / "tb"
    events = [p for p in os.listdir(tb) if p.startswith("events.out.tfevents")]
    assert events and os.path.getsize(tb / events[0]) > 0


def test_metrics_writer_appends_on_resume(tmp_path):
    with mon.MetricsWriter(str(tmp_path), enabled=True) as w:
        w.write(1, {"loss": 2.0})
    with mon.MetricsWriter(str(tmp_path), enabled=True) as w:
        w.write(2, {"loss": 1.0})
    assert [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_metrics_writer_disabled_writes_nothing(tmp_path):
    d = tmp_path / "work"
    w = mon.MetricsWriter(str(d), enabled=False)
    w.write(1, {"loss": 1.0})
    w.close()
    assert not d.exists()


def test_console_plain_lines():
    out = io.StringIO()  # not a tty
    c = mon.Console(enabled=True, total_steps=100, start_step=0, stream=out)
    c.update(1)  # not a log step: prints nothing
    c.update(10, {"loss": 3.14159, "val_loss": 3.5, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 12345.6,
                  "tflops_per_device": 42.42, "mfu": None,
                  "bytes_in_use": 2 * 1024 ** 3, "peak_bytes_in_use": 3 * 1024 ** 3, "bytes_limit": 80 * 1024 ** 3})
    c.update(20, {"loss": 2.5, "mfu": 0.4567})
    c.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "\x1b" not in out.getvalue()  # no terminal escape codes in logs
    first = lines[0]
    for s in ("step 10/100", "loss 3.1416", "val_loss 3.5000", "lr 3.00e-04", "gnorm 0.5", "12,346 tok/s",
              "42.4 TFLOP/s/dev", "MFU n/a", "mem 2.00/80.00 GiB (peak 3.00)"):
        assert s in first, (s, first)
    assert "loss 2.5000" in lines[1] and "MFU 45.7%" in lines[1] and "val_loss" not in lines[1]


def test_console_line_on_cpu_and_for_dpo():
    """A CPU's rate in GFLOP/s (never "0.0 TFLOP/s"); DPO's reward margin and preference accuracies by short names."""
    line = mon.format_metrics(5, 10, {"loss": 0.1, "tflops_per_device": 0.0043, "rewards/margins": 1.5,
                                      "rewards/accuracies": 1.0, "val_rewards/accuracies": 0.9})
    for s in ("4.3 GFLOP/s/dev", "margin 1.500", "acc 1.00", "val_acc 0.90"):
        assert s in line, (s, line)


def test_console_disabled_prints_nothing():
    out = io.StringIO()
    c = mon.Console(enabled=False, total_steps=10, start_step=0, stream=out)
    c.update(5, {"loss": 1.0})
    c.close()
    assert out.getvalue() == ""


class _FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_console_tty_progress_bar_runs():
    out = _FakeTTY()
    c = mon.Console(enabled=True, total_steps=10, start_step=2, stream=out)
    for step in range(3, 11):
        c.update(step, {"loss": 1.0 / step} if step % 5 == 0 else None)
    c.close()
    text = out.getvalue()
    assert "loss 0.2000" in text and "loss 0.1000" in text


def test_profiler_window(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(m.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
    monkeypatch.setattr(m.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    p = mon.profile(str(tmp_path), (3, 5))
    for step in range(1, 8):
        p.maybe_start(step)
        calls.append(step)
        p.maybe_stop(step, block_on=jnp.ones(2))
    assert calls == [1, 2, ("start", str(tmp_path / "profile")), 3, 4, 5, ("stop",), 6, 7]
    # empty window: never traces
    calls.clear()
    q = mon.profile(str(tmp_path), ())
    for step in range(1, 4):
        q.maybe_start(step)
        q.maybe_stop(step)
    assert calls == []


def test_profiler_context_stops_on_error(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(m.jax.profiler, "start_trace", lambda d: calls.append("start"))
    monkeypatch.setattr(m.jax.profiler, "stop_trace", lambda: calls.append("stop"))
    with pytest.raises(RuntimeError):
        with mon.profile(str(tmp_path), (1, 10)) as p:
            p.maybe_start(1)
            raise RuntimeError("boom")
    assert calls == ["start", "stop"]


def test_profiler_real_trace_cpu(tmp_path):
    p = mon.profile(str(tmp_path), (1,))
    assert p.maybe_start(1)
    x = (jnp.ones((64, 64)) @ jnp.ones((64, 64))).sum()
    assert p.maybe_stop(1, block_on=x)
    files = [f for _, _, fs in os.walk(tmp_path / "profile") for f in fs]
    assert files, "profiler wrote no trace"


def test_wandb_honours_wandb_dir_and_keeps_the_steps_a_resume_does_again(corpus, tmp_path, monkeypatch):
    """Offline W&B: its files go to `$WANDB_DIR` when set (not WORKDIR/wandb); a resume from a checkpoint older than
    the last log logs the steps it does again a second time, W&B's own `_step` growing through both jobs and every
    record carrying its training `step` (what W&B plots against): none is dropped."""
    pytest.importorskip("wandb")
    import shutil

    from helpers import run_config, wandb_history
    from jaxpar import trainer

    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "wb").mkdir()
    c = run_config(corpus, tmp_path, **{"mesh.data": 1, "train.steps": 4, "model.layers": 1})
    c.checkpoint.update(every_steps=2, async_save=False)
    c.log.wandb_project = "jaxpar-test"
    wd, one = tmp_path / "run", jax.devices()[:1]
    trainer.run(c, str(wd), one)
    shutil.rmtree(wd / "checkpoints" / "4")  # the resume starts from step 2: steps 3 and 4 are done again
    trainer.run(c, str(wd), one)
    history, run_id = wandb_history(tmp_path / "wb"), (wd / "wandb_id").read_text().strip()
    assert list(history) == [run_id] and not (wd / "wandb").exists()
    logged = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [(s, loss) for _, s, loss in history[run_id]] == [(r["step"], r["loss"]) for r in logged]
    assert [s for s, _, _ in history[run_id]] == list(range(6)) and [r["step"] for r in logged] == [1, 2, 3, 4, 3, 4]
