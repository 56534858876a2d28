"""lm-eval over jaxpar (`jaxpar/evaluate`) against lm-eval's own `hf` backend on the same tiny random Llama
directory: per request the log-likelihoods (float32, rel 1e-4) and is_greedy, the rolling log-likelihoods, the
greedy generations (stop sequences), and the task metrics; on 1 device and on (data 2, tensor 2, stage 2) 1F1B
(the pipeline's own forward; its microbatches, not given, picked: mesh.stage). Tasks: local YAMLs in
tests/fixtures/lm_eval (multiple choice, rolling, generation)."""
import os

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import chat_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ["jaxpar_mc", "jaxpar_rolling", "jaxpar_gen"]
LAYOUTS = {"one_device": ([], 1),
           "2x2x2_1f1b": (["--config.mesh.data=2", "--config.mesh.tensor=2", "--config.mesh.stage=2",
                           "--config.pipeline.schedule=1f1b"], 8)}  # train.microbatches not given: mesh.stage


def tiny_llama(directory):
    """A 4-layer random Llama (GQA, untied head, 64 positions) with a ChatML BPE tokenizer, saved as transformers
    saves it; BOS/EOS ids the tokenizer's."""
    tok = chat_tokenizer(directory)
    ids = lambda t: tok.hf.token_to_id(t)  # noqa: E731
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=64,
                                   rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                   bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF's init zeroes biases and sets norm scales to 1, which would hide mistakes
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    return str(directory)


def evaluate(lm):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=lm, tasks=TASKS, task_manager=TaskManager(include_path=os.path.join(
        ROOT, "tests/fixtures/lm_eval")), log_samples=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("evaluate") / "llama")


@pytest.fixture(scope="module")
def hf_results(model_dir):
    from lm_eval.models.huggingface import HFLM

    os.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    lm = HFLM(pretrained=model_dir, dtype="float32", batch_size=4, device="cpu")
    return lm, evaluate(lm)


def by_doc(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def assert_same(got, want):
    """Per request: log-likelihoods rel 1e-4 and is_greedy equal, rolling sums rel 1e-4, generations equal; then
    every metric."""
    for task in TASKS:
        g, w = by_doc(got, task), by_doc(want, task)
        assert len(g) == len(w) > 0
        for a, b in zip(g, w):
            for ra, rb in zip(a["resps"], b["resps"]):
                if isinstance(rb[0], str):
                    assert ra[0] == rb[0], (task, a["doc_id"], ra, rb)
                    continue
                va, vb = (ra[0], rb[0]) if np.ndim(rb[0]) == 0 else (ra[0][0], rb[0][0])
                np.testing.assert_allclose(va, vb, rtol=1e-4, err_msg=f"{task} doc {a['doc_id']}")
                if np.ndim(rb[0]):
                    assert ra[0][1] == rb[0][1], (task, a["doc_id"], ra, rb)
        for k, v in want["results"][task].items():
            if isinstance(v, float):
                np.testing.assert_allclose(got["results"][task][k], v, rtol=1e-4, err_msg=f"{task} {k}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tasks_equal_lm_eval_hf_backend(model_dir, hf_results, layout):
    from lm_eval.api.instance import Instance

    from jaxpar.evaluate.lm import JaxparLM
    from jaxpar.generate.engine import Request
    from jaxpar.generate.source import on_layout

    overrides, n = LAYOUTS[layout]
    source = on_layout("hf:" + model_dir, overrides, 4, devices=jax.devices()[:n])
    assert dict(source.steps.mesh.shape)["stage"] == (2 if n == 8 else 1)
    assert int(source.config.train.microbatches) == (2 if n == 8 else 1)
    got_lm = JaxparLM(source=source, batch_size=4)
    got = evaluate(got_lm)
    hf_lm, want = hf_results
    assert_same(got, want)
    gens = [s["resps"][0][0] for s in by_doc(got, "jaxpar_gen")]
    assert any(gens) and all("\n" not in t and "." not in t for t in gens)  # stopped, cut at the stop strings
    longest = max(len(JaxparLM.tok_encode(got_lm, s["doc"]["text"])) for s in by_doc(got, "jaxpar_rolling"))
    assert longest > 2 * got_lm.max_length  # several rolling windows
    # is_greedy where it is true: 4 greedy tokens after each multiple-choice context, scored by both backends
    contexts = [got_lm.tok_encode(s["arguments"][0][0]) for s in by_doc(got, "jaxpar_mc")]
    done = got_lm.engine.generate([Request(prompt=ctx, max_new_tokens=4) for ctx in contexts])
    reqs = [(None, ctx, c.tokens) for ctx, c in zip(contexts, done)]
    ours, theirs = got_lm._loglikelihood_tokens(reqs), hf_lm._loglikelihood_tokens(reqs)
    assert all(g for _, g in ours) and all(g for _, g in theirs)
    np.testing.assert_allclose([lp for lp, _ in ours], [lp for lp, _ in theirs], rtol=1e-4)
    # an empty continuation: (0.0, True) as the hf backend has it, nothing computed (the other request unchanged)
    reqs = [Instance("loglikelihood", {}, args, i) for i, args in enumerate(
        [("Question: the lazy dog", ""), ("Question: the lazy dog", " jumps")])]
    ours, theirs = got_lm.loglikelihood(reqs), hf_lm.loglikelihood(reqs)
    assert ours[0] == theirs[0] == (0.0, True)
    np.testing.assert_allclose(ours[1][0], theirs[1][0], rtol=1e-4)


def test_command_line_writes_lm_eval_results(model_dir, hf_results, tmp_path, capsys):
    """`python -m jaxpar.evaluate` on (data 4, tensor 2): lm-eval's results JSON and samples files, the metrics and
    each request's log-likelihoods those of the hf backend; a table printed."""
    import glob
    import json

    from jaxpar.evaluate.__main__ import main

    assert main(["--model", "hf:" + model_dir, "--tasks", "jaxpar_mc", "--include_path",
                 os.path.join(ROOT, "tests/fixtures/lm_eval"), "--output_path", str(tmp_path), "--log_samples",
                 "--batch_size", "4", "--config.mesh.tensor=2"]) == 0
    assert "|jaxpar_mc" in capsys.readouterr().out
    (res,) = glob.glob(str(tmp_path / "*" / "results_*.json"))
    with open(res) as f:
        got = json.load(f)
    want = hf_results[1]
    assert got["results"]["jaxpar_mc"]["acc,none"] == want["results"]["jaxpar_mc"]["acc,none"]
    (smp,) = glob.glob(str(tmp_path / "*" / "samples_jaxpar_mc_*.jsonl"))
    with open(smp) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    theirs = by_doc(want, "jaxpar_mc")
    np.testing.assert_allclose([float(r[0][0]) for s in rows for r in s["resps"]],
                               [r[0][0] for s in theirs for r in s["resps"]], rtol=1e-4)


def test_a_task_needing_a_download_is_one_line(tmp_path):
    """Offline, a task whose dataset is not in the Hugging Face cache: one line naming it and `hf download`,
    before any model is read (the model given does not exist)."""
    import subprocess
    import sys

    (tmp_path / "hub_task.yaml").write_text(
        "task: jaxpar_hub_task\ndataset_path: jaxpar-tests/not-in-any-cache\ntest_split: test\n"
        "output_type: loglikelihood\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "jaxpar.evaluate", "--model", "hf:" + str(tmp_path / "none"),
                        "--tasks", "jaxpar_hub_task", "--include_path", str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: task jaxpar_hub_task needs the dataset jaxpar-tests/not-in-any-cache"), last
    assert "hf download jaxpar-tests/not-in-any-cache --repo-type dataset" in last


def test_tasks_during_training_equal_the_command_line_on_that_checkpoint(model_dir, tmp_path):
    """`eval.tasks` in a (2, 2, 2) 1F1B run from `init_from=hf:DIR`: step 2's `eval/jaxpar_mc/*` in metrics.jsonl
    and lm_eval/step_2.json equal `python -m jaxpar.evaluate` on step 2's checkpoint (the run's layout)."""
    import glob
    import json

    from helpers import tiny_config

    from jaxpar.evaluate.__main__ import main
    from jaxpar.formats import hf
    from jaxpar.trainer import run

    (tmp_path / "text").mkdir()
    for i in range(10):
        (tmp_path / "text" / f"{i}.txt").write_text("the quick brown fox jumps over the lazy dog. hello world.\n" * 30)
    c = tiny_config(**{"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "pipeline.schedule": "1f1b",
                       "train.microbatches": 2, "train.global_batch_size": 8, "model.seq_len": 32, "train.steps": 2})
    c.init_from = "hf:" + model_dir
    c.data.update(sources=str(tmp_path / "text" / "*.txt"), cache_dir=str(tmp_path / "cache"))
    c.log.update(every_steps=10, progress=False)
    c.checkpoint.update(every_steps=2, async_save=False)
    c.eval.update(every_steps=100, batches=1, tasks="jaxpar_mc", tasks_every_steps=1,
                  tasks_include=os.path.join(ROOT, "tests/fixtures/lm_eval"))
    workdir = str(tmp_path / "run")
    run(hf.apply(c, say=False), workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logged = {r["step"]: r for r in map(json.loads, f)}
    assert {k for k in logged[2] if k.startswith("eval/")} == {"eval/jaxpar_mc/acc", "eval/jaxpar_mc/acc_norm"}
    assert os.path.isfile(os.path.join(workdir, "lm_eval", "step_1.json"))  # every step (tasks_every_steps=1)
    with open(os.path.join(workdir, "lm_eval", "step_2.json")) as f:
        kept = json.load(f)["results"]["jaxpar_mc"]
    assert main(["--model", workdir + "@2", "--tasks", "jaxpar_mc", "--include_path",
                 os.path.join(ROOT, "tests/fixtures/lm_eval"), "--output_path", str(tmp_path / "cli")]) == 0
    (res,) = glob.glob(str(tmp_path / "cli" / "*" / "results_*.json"))
    with open(res) as f:
        cli = json.load(f)["results"]["jaxpar_mc"]
    for k in ("acc,none", "acc_norm,none"):
        assert kept[k] == cli[k] == logged[2][f"eval/jaxpar_mc/{k.split(',')[0]}"], k


def test_padded_lengths_are_few_and_fit_the_layout():
    from jaxpar.evaluate.scores import bucket

    assert [bucket(n, 64) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert bucket(20, 128, 48) == 48 and bucket(50, 256, 48) == 96  # multiples of what the layout splits
    assert bucket(100, 100) == 112  # never past max_positions rounded up to the multiple
