"""Models and datasets by their Hub names, and runs in Weights & Biases, without a network: a Hugging Face cache built
here in the cache's own layout (blobs, refs/main, snapshots/COMMIT with links into the blobs) holds a tiny random
Llama with its chat tokenizer and a conversation dataset (Parquet, a README whose `configs` name the splits);
`HF_HUB_OFFLINE=1`. A run from `init_from=hf:ORG/NAME` and `data.sources=hfds:ORG/NAME` trains exactly as the same
files given as local paths; W&B runs offline (`WANDB_MODE=offline`) and its run files are read back with wandb's
own reader."""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
hf_constants = pytest.importorskip("huggingface_hub.constants")

from helpers import ROOT, chat_tokenizer, losses, wandb_history  # noqa: E402
from jaxpar.formats import hub  # noqa: E402
from jaxpar.config import base_config  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.xdist_group("test_hub")]
CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: test
    path: data/test-*
---
# a tiny conversation dataset
"""


def put(cache, kind: str, repo: str, files: dict, ref: str = "main") -> str:
    """Store `files` ({path in the repository: bytes}) as one commit of `repo` in the Hugging Face cache `cache`,
    as huggingface_hub lays it out; `ref` points at it. -> the commit."""
    folder = cache / f"{kind}s--{repo.replace('/', '--')}"
    commit = hashlib.sha1(json.dumps({k: hashlib.sha256(v).hexdigest() for k, v in sorted(files.items())})
                          .encode()).hexdigest()
    for path, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            os.symlink(os.path.relpath(blob, link.parent), link)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return commit


def conversations(n: int, seed: int) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over lazy dog what is it answer be brief hello world".split()
    say = lambda k: " ".join(rng.choice(words, k))  # noqa: E731
    return [{"messages": [{"role": "user", "content": say(rng.integers(2, 8))},
                          {"role": "assistant", "content": say(rng.integers(1, 10))}]} for _ in range(n)]


def parquet_bytes(rows: list) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """(root, the cache, the model's directory, the dataset's local train and test files, their commits)."""
    root = tmp_path_factory.mktemp("hub")
    model_dir = root / "tiny-llama"
    tok = chat_tokenizer(model_dir)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        max_position_embeddings=128, vocab_size=tok.vocab_size, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=False)).save_pretrained(model_dir)
    cache = root / "hf-cache"
    model = put(cache, "model", "tiny-org/tiny-llama", {p.name: p.read_bytes() for p in model_dir.iterdir()})
    train, test = parquet_bytes(conversations(48, 0)), parquet_bytes(conversations(8, 1))
    for name, b in (("train.parquet", train), ("test.parquet", test)):
        (root / name).write_bytes(b)
    dataset = put(cache, "dataset", "tiny-org/chat", {"README.md": CARD.encode(), "data/train-00000-of-00001.parquet":
                                                      train, "data/test-00000-of-00001.parquet": test})
    return root, cache, model_dir, {"model": model, "dataset": dataset}


def env(cache, **more):
    """Offline Hub and W&B; one CPU device (the inherited XLA_FLAGS, e.g. --xla_cpu_max_isa, kept)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
            "WANDB_SILENT": "true", "XLA_FLAGS": flags + " --xla_force_host_platform_device_count=1", **more}


def train_cmd(workdir, init_from, sources, val_source, steps=2, *extra):
    return [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/shakespeare.py"),
            "--workdir", str(workdir), f"--config.init_from={init_from}", f"--config.data.sources={sources}",
            f"--config.data.val_source={val_source}", "--config.data.packing=bfd", "--config.model.seq_len=32",
            f"--config.data.cache_dir={workdir.parent / 'data-cache'}", "--config.train.global_batch_size=4",
            f"--config.train.steps={steps}", "--config.log.every_steps=1", "--config.eval.every_steps=2",
            "--config.eval.batches=1", "--config.checkpoint.every_steps=100000", "--config.log.progress=False",
            *extra]


def test_hub_names_train_as_the_same_files_given_as_paths(hub_cache):
    """`hf:ORG/NAME` + `hfds:ORG/NAME` (validation: the `test` split by name) train, loss for loss, as the same
    checkpoint directory and Parquet files given as paths; the workdir records the commits."""
    root, cache, model_dir, commits = hub_cache
    named = subprocess.run(train_cmd(root / "named", "hf:tiny-org/tiny-llama", "hfds:tiny-org/chat",
                                     "hfds:tiny-org/chat:test"), env=env(cache), cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert named.returncode == 0, named.stderr[-3000:]
    local = subprocess.run(train_cmd(root / "local", f"hf:{model_dir}", f"parquet:{root / 'train.parquet'}",
                                     f"parquet:{root / 'test.parquet'}"), env=env(cache), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr[-3000:]
    assert losses(root / "named") == losses(root / "local") and len(losses(root / "named")) == 2
    val = [[json.loads(x)["val_loss"] for x in open(root / d / "metrics.jsonl") if "val_loss" in x]
           for d in ("named", "local")]
    assert len(val[0]) == 1 and val[0] == val[1]
    assert json.load(open(root / "named" / "hub.json")) == {
        "hf:tiny-org/tiny-llama": commits["model"], "hfds:tiny-org/chat": commits["dataset"],
        "hfds:tiny-org/chat:test": commits["dataset"]}
    assert f"hf:tiny-org/tiny-llama -> commit {commits['model']}" in named.stdout + named.stderr


def test_a_name_missing_from_the_cache_is_one_line_and_writes_nothing(hub_cache, tmp_path):
    root, cache, _, _ = hub_cache
    res = subprocess.run(train_cmd(tmp_path / "run", "hf:tiny-org/nope", "hfds:tiny-org/chat", ""), env=env(cache),
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: hf:tiny-org/nope: the model tiny-org/nope is not in the Hugging Face cache") and \
        "HF_HUB_OFFLINE=1" in line and str(cache) in line, res.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def config_with(**data):
    c = base_config()
    c.data.update(**data)
    return c


def test_a_resume_resolves_the_commit_the_first_start_recorded(hub_cache, tmp_path, monkeypatch):
    """main moves on to a new commit; a name pinned in the workdir's hub.json still reads the old one, an explicit
    @REVISION wins, an unpinned name reads main's."""
    root, cache, _, commits = hub_cache
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    newer = put(cache, "dataset", "tiny-org/moving", {"train.jsonl": b'{"text": "new"}\n'})
    older = put(cache, "dataset", "tiny-org/moving", {"train.jsonl": b'{"text": "old"}\n'}, ref="v1")
    (cache / "datasets--tiny-org--moving" / "refs" / "main").write_text(newer)
    c = config_with(sources="hfds:tiny-org/moving")
    out, pins = hub.resolve(c, {"hfds:tiny-org/moving": older})
    assert pins == {"hfds:tiny-org/moving": older} and out.data.sources == \
        f"jsonl:{cache}/datasets--tiny-org--moving/snapshots/{older}/**/train.jsonl"
    assert hub.resolve(c, {})[1] == {"hfds:tiny-org/moving": newer}
    assert hub.resolve(config_with(sources="hfds:tiny-org/moving@v1"), {})[1] == {"hfds:tiny-org/moving@v1": older}
    branch = config_with(sources="hfds:tiny-org/moving@main")  # a branch is pinned like the default one
    assert hub.resolve(branch, {"hfds:tiny-org/moving@main": older})[1] == {"hfds:tiny-org/moving@main": older}


def test_a_splits_files_by_the_card_the_option_or_the_usual_names(hub_cache, monkeypatch):
    root, cache, _, commits = hub_cache
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    snap = cache / "datasets--tiny-org--chat" / "snapshots" / commits["dataset"]
    src = lambda **d: hub.resolve(config_with(**d), {})[0].data.sources  # noqa: E731
    assert src(sources="hfds:tiny-org/chat:test") == f"parquet:{snap}/data/test-*.parquet"  # the card
    assert src(sources="hfds:tiny-org/chat", hf_data_files="data/test-*.parquet") == \
        f"parquet:{snap}/data/test-*.parquet"
    # no card: the usual names; a blend keeps its weights
    plain = put(cache, "dataset", "tiny-org/plain", {"train/part-0.jsonl": b'{"text": "a"}\n',
                                                      "validation.jsonl": b'{"text": "b"}\n'})
    base = cache / "datasets--tiny-org--plain" / "snapshots" / plain
    assert src(sources="0.5 hfds:tiny-org/plain 0.5 hfds:tiny-org/plain:validation") == \
        f"0.5 jsonl:{base}/train/**/*.jsonl 0.5 jsonl:{base}/**/validation.jsonl"
    with pytest.raises(ConfigError, match=r"^hfds:tiny-org/chat:dev: no Parquet or JSONL files of split 'dev' .* "
                                          r"it has README.md"):
        src(sources="hfds:tiny-org/chat:dev")
    with pytest.raises(ConfigError, match="is not a Hub dataset name"):
        src(sources="hfds:../x")
    # data.hf_data_files is the training sources' pattern: the validation split keeps its own
    c = hub.resolve(config_with(sources="hfds:tiny-org/chat", val_source="hfds:tiny-org/chat:test",
                                hf_data_files="data/train-*.parquet"), {})[0]
    assert c.data.val_source == f"parquet:{snap}/data/test-*.parquet"
    # a card with two patterns for one split: one glob cannot read both, so it is refused, not cut short
    card = CARD.replace("    path: data/test-*", "    path: [data/test-*, data/train-*]")
    put(cache, "dataset", "tiny-org/two", {"README.md": card.encode(), "data/test-0.parquet": b"x",
                                           "data/train-0.parquet": b"y"})
    with pytest.raises(ConfigError, match=r"under 2 patterns \(data/test-\*, data/train-\*\)"):
        src(sources="hfds:tiny-org/two:test")


def test_a_local_directory_wins_over_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hub.model_name("hf:org/model") is None and hub.model_name("hf:org/other").repo == "org/other"
    assert hub.model_name("hf:org/other@v2").revision == "v2" and hub.model_name("runs/x") is None


def test_a_wandb_run_holds_the_logged_metrics_and_a_resume_continues_it(hub_cache, corpus, tmp_path):
    """Offline W&B: the run's files hold metrics.jsonl's losses at its steps; SIGTERM, then the resumed job logs
    into the same run id."""
    pytest.importorskip("wandb")
    _, cache, _, _ = hub_cache
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/shakespeare.py"),
           "--workdir", str(tmp_path / "run"), f"--config.data.sources={corpus}/*.txt",
           f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.model.layers=2", "--config.model.embed=32",
           "--config.model.mlp=64", "--config.model.seq_len=16", "--config.train.global_batch_size=8",
           "--config.checkpoint.every_steps=100000", "--config.log.every_steps=1", "--config.eval.every_steps=100000",
           "--config.eval.batches=1", "--config.log.progress=False", "--config.log.wandb_project=jaxpar-test",
           "--config.log.wandb_tags=('ci',)"]
    first = subprocess.Popen(cmd + ["--config.train.steps=100000"], env=env(cache), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 75, first.stdout.read()[-3000:]
    stopped = max(losses(tmp_path / "run"))
    res = subprocess.run(cmd + [f"--config.train.steps={stopped + 2}"], env=env(cache), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    history = wandb_history(tmp_path / "run")
    run_id = (tmp_path / "run" / "wandb_id").read_text().strip()
    assert list(history) == [run_id] and len(list((tmp_path / "run" / "wandb").glob("offline-run-*"))) == 2
    assert [(step, loss) for _, step, loss in history[run_id]] == sorted(losses(tmp_path / "run").items())


def test_asking_for_wandb_without_the_package_is_one_line(corpus, tmp_path):
    code = ("import sys, importlib.util; real = importlib.util.find_spec; importlib.util.find_spec = "
            "lambda n, *a: None if n == 'wandb' else real(n, *a); sys.argv = sys.argv[1:]; import runpy; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "train.py"), "--config",
                          os.path.join(ROOT, "configs/shakespeare.py"), "--workdir", str(tmp_path / "run"),
                          f"--config.data.sources={corpus}/*.txt", "--config.log.wandb_project=p"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "pip install 'jaxpar[wandb]'" in res.stderr.strip().splitlines()[-1], res.stderr
    assert not (tmp_path / "run").exists()


def test_sample_takes_a_hub_name(hub_cache):
    root, cache, _, _ = hub_cache
    res = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--workdir", "hf:tiny-org/tiny-llama",
                          "--prompt", "hello", "--new_tokens", "3", "--temperature", "0"], env=env(cache), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("hello"), res.stderr[-2000:]
    res = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--workdir", "hf:tiny-org/none",
                          "--prompt", "x"], env=env(cache), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "not in the Hugging Face cache" in res.stderr, res.stderr[-2000:]


def test_a_peft_adapter_by_name_resolves_to_its_snapshot_and_a_dry_run_fetches_no_weights(hub_cache, monkeypatch):
    _, cache, _, commits = hub_cache
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    adapter = put(cache, "model", "tiny-org/adapter", {"adapter_config.json": b"{}", "adapter_model.safetensors": b"x",
                                                       "README.md": b"an adapter"})
    c = base_config()
    c.lora.adapter, c.init_from = "hf:tiny-org/adapter", "hf:tiny-org/tiny-llama"
    out, pins = hub.resolve(c, {})
    assert out.lora.adapter == str(cache / "models--tiny-org--adapter" / "snapshots" / adapter)
    assert out.init_from == f"hf:{cache}/models--tiny-org--tiny-llama/snapshots/{commits['model']}"
    calls = []
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo, **kw: calls.append(kw["allow_patterns"])
                        or str(cache / "models--tiny-org--tiny-llama" / "snapshots" / commits["model"]))
    hub.resolve(c, {}, weights=False, datasets=False)
    assert calls and not any("safetensors" in p for allow in calls for p in allow), calls
