"""Exports: a run's params as safetensors + JSON, the same whatever layout trained it; `load_export` checks every
array before it reads one; the CLI refuses bad input with exit code 2, writing nothing."""
import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import assert_params_exact, run_config, steps_for
from jaxpar import export, trainer
from jaxpar.state import runs
from jaxpar.formats import start
from jaxpar.data import ByteTokenizer
from jaxpar.generate.engine import Engine, Request
from jaxpar import model as gpt
from jaxpar.model import ModelConfig, init_params
from jaxpar.train.step import model_config

# one worker builds this module's shared fixtures once (under pytest-xdist `--dist loadgroup`)
pytestmark = pytest.mark.xdist_group("test_export")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSOR = {"mesh.data": 4, "mesh.tensor": 2, "train.steps": 3}
PIPELINE = {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "train.microbatches": 2,
            "pipeline.schedule": "circular", "pipeline.virtual_stages": 2, "model.layers": 4, "train.steps": 3}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxpar.export", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tensor_run(corpus, tmp_path_factory):
    """(workdir, export dir) of a data 4 x tensor 2 run, exported through the CLI."""
    tmp = tmp_path_factory.mktemp("tensor")
    wd, out = tmp / "run", tmp / "export"
    trainer.run(run_config(corpus, tmp, **TENSOR), str(wd))
    r = cli("--workdir", wd, "--out", out)
    assert r.returncode == 0, r.stderr
    return wd, out


@pytest.fixture(scope="module")
def pipeline_run(corpus, tmp_path_factory):
    """(workdir, export dir) of a 2-stage circular-pipeline run (2 virtual stages), exported through `main`."""
    tmp = tmp_path_factory.mktemp("pipeline")
    wd, out = tmp / "run", tmp / "export"
    trainer.run(run_config(corpus, tmp, **PIPELINE), str(wd))
    assert export.main(["--workdir", str(wd), "--out", str(out)]) == 0
    return wd, out


def float64_export(corpus, tmp, **over):
    """The export's arrays of a float64 run (JAX's x64 mode) of `run_config` with `over`."""
    wd, out = tmp / "run", tmp / "export"
    with jax.enable_x64(True):
        n = over.get("mesh.data", 1) * over.get("mesh.tensor", 1) * over.get("mesh.stage", 1)
        trainer.run(run_config(corpus, tmp, **over, **{"train.param_dtype": "float64",
                                                       "train.compute_dtype": "float64"}), str(wd),
                    devices=jax.devices()[:n])
        assert export.main(["--workdir", str(wd), "--out", str(out)]) == 0
    return load_file(str(out / export.WEIGHTS_FILE))


def bits(a):
    return a.dtype.str, a.shape, np.asarray(a).tobytes()


@pytest.mark.parametrize("which", ["tensor_run", "pipeline_run"])
def test_export_equals_the_checkpoint_bitwise(which, request):
    wd, out = request.getfixturevalue(which)
    fwd, params, tok = runs.load_params(str(wd))
    ref = export.flatten(params)
    got = load_file(str(out / export.WEIGHTS_FILE))
    assert sorted(got) == sorted(ref) and "blocks.wqkv" in got and "ln_f.scale" in got
    for k in ref:
        assert bits(got[k]) == bits(ref[k]), k
    meta = json.loads((out / export.CONFIG_FILE).read_text())
    assert meta["format"] == "jaxpar-gpt-v1" and meta["step"] == 3
    fields = {k: v for k, v in dataclasses.asdict(fwd.cfg).items() if k not in gpt.LORA_FIELDS}
    assert {k: meta[k] for k in fields} == fields
    assert (meta["tokenizer_kind"], meta["tokenizer_vocab_size"]) == ("byte", tok.vocab_size)


@pytest.mark.slow
def test_exports_are_layout_free(corpus, tmp_path):
    """The pipeline layout's layers come out in model order: after 3 AdamW steps its export equals the 1-device
    run's, float64 on both sides (`helpers.assert_params_exact`; a layer order left stage-major would be O(1) off)."""
    piped = float64_export(corpus, tmp_path / "pipeline", **PIPELINE)
    one = float64_export(corpus, tmp_path / "one", **{**PIPELINE, "mesh.data": 1, "mesh.tensor": 1, "mesh.stage": 1,
                                                      "train.microbatches": 1, "pipeline.schedule": "gpipe",
                                                      "pipeline.virtual_stages": 1})
    assert sorted(piped) == sorted(one) and all(piped[k].shape == one[k].shape for k in one)
    assert_params_exact(piped, one)


@pytest.mark.parametrize("which", ["tensor_run", "pipeline_run"])
def test_load_export_round_trips(which, request):
    wd, out = request.getfixturevalue(which)
    fwd, params, tok = runs.load_params(str(wd))
    efwd, eparams, etok = export.load_export(str(out))
    assert efwd.cfg == fwd.cfg and etok.kind == tok.kind and etok.vocab_size == tok.vocab_size
    assert jax.tree.structure(eparams) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(eparams), jax.tree.leaves(params)):
        assert isinstance(a, jax.Array) and a.devices() == {jax.devices()[0]}
        assert bits(np.asarray(a)) == bits(np.asarray(b))


def test_greedy_generation_from_the_export_equals_the_run(tensor_run):
    wd, out = tensor_run
    outs = []
    for fwd, params, tok in (runs.load_params(str(wd)), export.load_export(str(out))):
        prompt = [int(t) for t in tok.encode("to be or")]
        outs.append(np.asarray([prompt + Engine(fwd, params).generate([Request(prompt, max_new_tokens=6)])[0].tokens]))
    np.testing.assert_array_equal(outs[0], outs[1])
    # sample.py loads an export too
    r = subprocess.run([sys.executable, "sample.py", f"--workdir={out}", "--prompt=to be or", "--new_tokens=6",
                        "--temperature=0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == tok.decode(outs[1][0].tolist()).split("\n")[0]


def test_cli_missing_workdir_exits_2_and_writes_nothing(tmp_path):
    r = cli("--workdir", tmp_path / "nowhere", "--out", tmp_path / "out")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "nowhere" in last
    assert sorted(os.listdir(tmp_path)) == []


def test_bad_input_exits_2_and_writes_nothing(tensor_run, tmp_path, capsys):
    wd, _ = tensor_run
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert export.main(["--workdir", str(wd), "--out", str(full)]) == 2
    assert "not empty" in capsys.readouterr().err and os.listdir(full) == ["keep.txt"]
    assert export.main(["--workdir", str(wd), "--out", str(tmp_path / "x"), "--step", "2"]) == 2
    assert "step 2" in capsys.readouterr().err
    untrained = tmp_path / "untrained"  # a config and a tokenizer, no checkpoint
    untrained.mkdir()
    shutil.copy(wd / "config.json", untrained)
    shutil.copytree(wd / "tokenizer", untrained / "tokenizer")
    assert export.main(["--workdir", str(untrained), "--out", str(tmp_path / "x")]) == 2
    assert "checkpoint" in capsys.readouterr().err
    assert sorted(os.listdir(untrained)) == ["config.json", "tokenizer"]
    assert sorted(os.listdir(tmp_path)) == ["full", "untrained"]
    # --force replaces the export's entries and leaves other files alone
    assert export.main(["--workdir", str(wd), "--out", str(full), "--force"]) == 0
    assert export.main(["--workdir", str(wd), "--out", str(full), "--force"]) == 0
    assert sorted(os.listdir(full)) == ["keep.txt", "model.safetensors", "model_config.json", "tokenizer"]
    assert sorted(os.listdir(tmp_path)) == ["full", "untrained"]  # no temporary directory left behind
    export.load_export(str(full))


def _tamper_weights(fn):
    def tamper(d):
        flat = load_file(str(d / export.WEIGHTS_FILE))
        fn(flat)
        save_file(flat, str(d / export.WEIGHTS_FILE))
    return tamper


def _tamper_config(fn):
    def tamper(d):
        meta = json.loads((d / export.CONFIG_FILE).read_text())
        fn(meta)
        (d / export.CONFIG_FILE).write_text(json.dumps(meta))
    return tamper


@pytest.mark.parametrize("tamper,match", [
    (_tamper_weights(lambda f: f.pop("blocks.wqkv")), r"missing array 'blocks.wqkv'"),
    (_tamper_weights(lambda f: f.update({"ln_f.scale": f["ln_f.scale"][:-1]})), r"'ln_f.scale' is F32\[31\]"),
    (_tamper_weights(lambda f: f.update({"wpe": f["wpe"].astype(np.float16)})), r"'wpe' is F16"),
    (_tamper_weights(lambda f: f.update({"lm_head": f["wte"].T.copy()})), r"unexpected array 'lm_head'"),
    (_tamper_config(lambda m: m.update(format="something-else")), r"format"),
    (_tamper_config(lambda m: m.update(layers="4")), r"'layers'"),
    (_tamper_config(lambda m: m.update(layers=5)), r"'blocks\.\w+' is F32\[4, .*expected F32\[5,"),
    (lambda d: (d / export.WEIGHTS_FILE).write_bytes(b"\x80\x04garbage"), r"not a readable safetensors"),
])
def test_tampered_export_is_refused_naming_the_mismatch(tensor_run, tmp_path, tamper, match):
    d = tmp_path / "export"
    shutil.copytree(tensor_run[1], d)
    tamper(d)
    with pytest.raises(ValueError, match=match):
        export.load_export(str(d))


def test_export_holds_no_pickle(tensor_run):
    out = tensor_run[1]
    files = sorted(os.path.relpath(os.path.join(r, f), out) for r, _, fs in os.walk(out) for f in fs)
    assert files == ["model.safetensors", "model_config.json", "tokenizer/byte_tokenizer.json"]
    raw = (out / export.WEIGHTS_FILE).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])  # the whole header is JSON ...
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n  # ... and the rest is raw arrays, back to back
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}


def test_bfloat16_params_round_trip(tmp_path):
    cfg = ModelConfig(vocab_size=256, vocab_real=256, seq_len=8, layers=2, embed=16, heads=2, mlp=32,
                    tie_embeddings=False, param_dtype="bfloat16")
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)
    d = tmp_path / "bf16"
    d.mkdir()
    save_file(export.flatten(params), str(d / export.WEIGHTS_FILE))
    (d / export.CONFIG_FILE).write_text(json.dumps({"format": export.FORMAT, **dataclasses.asdict(cfg), "step": 0}))
    ByteTokenizer().save(d / "tokenizer")
    fwd, got, _ = export.load_export(str(d))
    assert fwd.cfg == cfg and got["lm_head"].dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        assert bits(np.asarray(a)) == bits(np.asarray(b))


def test_flatten_unflatten():
    tree = {"wte": np.zeros((2, 3)), "blocks": {"ln1": {"scale": np.ones(3)}, "wo": np.arange(4.0)}}
    flat = export.flatten(tree)
    assert sorted(flat) == ["blocks.ln1.scale", "blocks.wo", "wte"]
    back = export.unflatten(flat)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)))
    with pytest.raises(ValueError, match="a.b"):
        export.flatten({"a.b": np.zeros(1)})
    with pytest.raises(ValueError, match="also"):
        export.unflatten({"a": 1, "a.b": 2})
    with pytest.raises(ValueError, match="empty"):
        export.unflatten({"a..b": 1})


def test_init_from_places_the_export_in_another_layout(tensor_run, corpus, tmp_path):
    """Fine-tuning start: an export of a (4,2,1) run placed into a circular (2,2,2) layout, bitwise."""
    _, out = tensor_run
    c = run_config(corpus, tmp_path, **{**PIPELINE, "model.layers": 4})
    steps = steps_for(c, 256)
    state = start.place(str(out), steps, steps.init(7))
    got = jax.device_get(steps.to_canonical(state)["params"])
    want = export.flatten(export.load_export(str(out))[1])
    for k, a in export.flatten(got).items():
        assert bits(a) == bits(want[k]), k
    assert int(state["step"]) == 0


def test_init_from_brings_the_exports_model_and_refuses_another_before_writing_anything(tensor_run, corpus,
                                                                                         tmp_path):
    """A start from an export takes its model shape and tokenizer (as `hf:DIR`), whatever the config says; a model
    that still differs (the check behind it) and a path that is no starting point are refused before any write."""
    _, out = tensor_run
    c = run_config(corpus, tmp_path, **{"mesh.data": 8, "model.embed": 64, "model.seq_len": 8, "train.steps": 1})
    c.init_from = str(out)
    got = start.apply(c, say=False)
    want = json.loads((out / export.CONFIG_FILE).read_text())
    assert (got.model.embed, got.model.layers, got.model.seq_len) == (want["embed"], want["layers"], 8)
    assert got.data.tokenizer == "byte" and c.model.embed == 64  # (the config given is not changed)
    with pytest.raises(trainer.ConfigError, match="embed: export 32 vs config 64"):
        start.check(str(out), model_config(c, 256, 1))
    c = run_config(corpus, tmp_path, **{"mesh.data": 8, "train.steps": 1})
    c.init_from = str(tmp_path / "no_export")
    with pytest.raises(trainer.ConfigError, match="neither a jaxpar export"):
        trainer.run(c, str(tmp_path / "ft"))
    assert not (tmp_path / "ft").exists()
