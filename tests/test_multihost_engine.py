"""The engine on several processes as several hosts run it: GRPO, `python -m jaxpar.generate` and `python -m
jaxpar.evaluate` started by `python -m jaxpar.launch` as 2 processes x 4 CPU devices against 1 process x 8 devices, on (data, tensor) = (4, 2) (data spans the processes), in float64 (the comparison
after optimizer steps is then free of the summation order of the collectives). Every process takes part in each
round: the engine runs on the global mesh, each process scores its share of the round's groups and the scores and
what the reward functions logged are gathered, so the advantages and the metrics are the one-process values; the
completions JSONL and the metrics are written once (process 0); a kill inside a round resumes exactly. Generation
and evaluation write their outputs once, in input order, equal to one process's; an interrupted generation resumes."""
import json
import os
import shutil
import sys

import pytest

from helpers import chat_tokenizer, random_hf_llama

pytestmark = [pytest.mark.serial, pytest.mark.xdist_group("processes"), pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("tokens_per_s", "step_time_s", "tflops_per_device", "mfu", "data_wait_s", "time/generate_s", "time/score_s",
          "time/train_s", "rollout_tokens_per_s")
REWARD = """import jax

def odd(completion_ids, solution, trainer_state, log_metric, log_extra, **kw):
    share = len(completion_ids) * jax.process_count()  # (this process's share: of a round's 16 or 4 held out)
    assert len(solution) == len(completion_ids) and share in (16, 4), share
    log_metric("seen_step", trainer_state.global_step)
    log_extra("process", [jax.process_index()] * len(completion_ids))
    return [sum(i % 2 for i in c) / len(c) for c in completion_ids]
"""
CONFIG = """from jaxpar.config import base_config

def get_config():
    c = base_config()
    c.model.update(seq_len=48)
    c.mesh.update(data=4, tensor=2)
    c.train.update(objective="grpo", steps=4, global_batch_size=4, seed=0, param_dtype="float64",
                   compute_dtype="float64")
    c.grpo.update(num_generations=4, max_completion_length=8, rewards="{root}/reward.py:odd", beta=0.04,
                  epsilon=0.2, num_iterations=2, log_completions=16)
    c.optim.update(lr=3e-3, warmup_steps=0, decay_steps=10, clip_norm=1.0)
    c.init_from = "hf:{root}/base"
    c.data.update(sources="{root}/prompts.jsonl", cache_dir="{root}/cache", val_fraction=0.2)
    c.log.update(every_steps=2, progress=False)
    c.eval.update(every_steps=4, batches=1)
    c.checkpoint.update(every_steps=3, keep=3, async_save=False)
    return c
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny chat Llama (hf:DIR), 40 prompt records, a reward that asserts it sees its process's share; the run of
    4 steps (mu = 2: checkpoint 3 lies inside round 1) on 1 x 8 and on 2 x 4 devices."""
    from jaxpar import launch
    from jaxpar.data import BPETokenizer

    root = tmp_path_factory.mktemp("multihost_rl")
    chat_tokenizer(root / "base")
    random_hf_llama(root / "base", BPETokenizer.from_file(root / "base" / "tokenizer.json"))
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
                                "solution": str(2 * i)}) + "\n")
    (root / "reward.py").write_text(REWARD)
    (root / "config.py").write_text(CONFIG.format(root=root))
    env = dict(launch.cpu_env(os.environ, 8), JAX_ENABLE_X64="1")
    for name, processes in (("one", 1), ("two", 2)):
        assert run(root, name, processes, env).returncode == 0
    return root, env


def run(root, name, processes, env):
    import subprocess

    args = [os.path.join(ROOT, "train.py"), "--config", str(root / "config.py"), "--workdir", str(root / name)]
    if name == "one":  # (1 process: the first run's data cache is the second's)
        args += [f"--config.data.cache_dir={root}/cache_one"]
    launcher = [sys.executable, "-m", "jaxpar.launch", "--num_processes", "2", "--devices_per_process", "4", "--"]
    res = subprocess.run((launcher if processes > 1 else [sys.executable]) + args, env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: {k: v for k, v in r.items() if k not in TIMING} for r in map(json.loads, f)}


def completions(workdir):
    with open(os.path.join(workdir, "completions.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same_run(a, b):
    assert sorted(a) == sorted(b) == [2, 4]
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for k, v in a[step].items():  # rewards and lengths exactly; losses, KL, entropy within float64's rounding
            assert v == pytest.approx(b[step][k], rel=1e-9, abs=1e-12), (step, k, v, b[step][k])
        assert {k: v for k, v in a[step].items() if "reward" in k} == \
            {k: v for k, v in b[step].items() if "reward" in k}, step


def test_two_processes_run_grpo_like_one(runs):
    """The metrics of every log step equal (rewards, lengths and what reward functions logged exactly; the losses
    within 1e-9); the completions logged once, in order, equal, each scored by the process whose share it is."""
    root, _ = runs
    assert_same_run(metrics(root / "two"), metrics(root / "one"))
    two, one = completions(root / "two"), completions(root / "one")
    assert [r["process"] for r in two] == [0] * 8 + [1] * 8 + [0] * 8 + [1] * 8  # (2 logged rounds of 16)
    assert [r["process"] for r in one] == [0] * 32
    strip = lambda rows: [{k: v for k, v in r.items() if k != "process"} for r in rows]  # noqa: E731
    assert strip(two) == strip(one)


def test_a_multi_host_grpo_run_killed_inside_a_round_resumes_exactly(runs):
    """Killed after step 3's checkpoint (inside round 1: its sampled batch kept beside it) and resumed on 2
    processes: step 4 logs what the uninterrupted run logged."""
    root, env = runs
    parted = root / "parted"
    shutil.copytree(root / "two", parted)
    shutil.rmtree(parted / "checkpoints" / "4")
    os.remove(parted / "rollouts" / "step-4.npz")
    for name in ("metrics.jsonl", "completions.jsonl"):
        kept = [line for line in open(parted / name) if json.loads(line)["step"] <= 3]
        (parted / name).write_text("".join(kept))
    out = run(root, "parted", 2, env)
    assert "start step 3" in out.stdout + out.stderr
    assert_same_run(metrics(parted), metrics(root / "two"))
    assert completions(parted) == completions(root / "two")


LAUNCH = [sys.executable, "-m", "jaxpar.launch", "--num_processes", "2", "--devices_per_process", "4", "--"]
LAYOUT = ["--config.mesh.data=4", "--config.mesh.tensor=2"]


def launched(*args):
    import subprocess

    from jaxpar import launch

    res = subprocess.run(LAUNCH + list(args), env=launch.cpu_env(os.environ, 8), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def test_generation_on_two_processes_writes_one_process_output_once_and_resumes(runs, tmp_path):
    """10 prompts x 2 samples at temperature 1 on (data 4, tensor 2): the 2-process file equals the 1-process
    file line for line (tokens and log-probs), written once; cut to 4 records and rerun on 2 processes, it ends
    equal again."""
    from jaxpar.generate.__main__ import main

    root, _ = runs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(10)))
    args = lambda out: ["--model", f"hf:{root}/base", "--prompts", str(prompts), "--out", str(out),  # noqa: E731
                        "--max_new_tokens", "8", "--temperature", "1", "--n", "2", "--slots", "8", "--progress", "0",
                        *LAYOUT]
    assert main(args(tmp_path / "one.jsonl")) == 0
    out = launched("-m", "jaxpar.generate", *args(tmp_path / "two.jsonl"))
    one = (tmp_path / "one.jsonl").read_text().splitlines()
    assert (tmp_path / "two.jsonl").read_text().splitlines() == one and len(one) == 10
    assert out.count("10 records (0 already in") == 1  # (process 0 alone reports and writes)
    (tmp_path / "two.jsonl").write_text("\n".join(one[:4]) + "\n")
    assert "6 records (4 already in" in launched("-m", "jaxpar.generate", *args(tmp_path / "two.jsonl"))
    assert (tmp_path / "two.jsonl").read_text().splitlines() == one


def test_evaluation_on_two_processes_gives_one_process_results_written_once(runs, tmp_path):
    """lm-eval's multiple-choice and generation tasks on (data 4, tensor 2): the 2-process samples (each
    request's log-likelihood within 1e-6, generated text equal) and metrics equal the 1-process run's; one results
    file, one table."""
    import glob

    from jaxpar.evaluate.__main__ import main

    root, _ = runs
    args = lambda out: ["--model", f"hf:{root}/base", "--tasks", "jaxpar_mc,jaxpar_gen", "--include_path",  # noqa
                        os.path.join(ROOT, "tests/fixtures/lm_eval"), "--output_path", str(out), "--log_samples",
                        "--batch_size", "4", *LAYOUT]
    cwd = os.getcwd()
    os.chdir(ROOT)  # (the tasks' data files are relative to the repository root)
    try:
        assert main(args(tmp_path / "one")) == 0
    finally:
        os.chdir(cwd)
    out = launched("-m", "jaxpar.evaluate", *args(tmp_path / "two"))
    assert out.count("|jaxpar_mc") == 1
    files = {n: sorted(glob.glob(str(tmp_path / n / "*" / "*"))) for n in ("one", "two")}
    assert len(files["one"]) == len(files["two"]) == 3
    for a, b in zip(files["one"], files["two"]):
        if "samples_" in a:
            ra, rb = ([json.loads(line)["resps"] for line in open(f)] for f in (a, b))
            assert len(ra) == len(rb) and all(len(x) == len(y) for x, y in zip(ra, rb))
            for x, y in ((x, y) for sa, sb in zip(ra, rb) for x, y in zip(sa, sb)):  # a request's response
                if isinstance(x[0], list):  # loglikelihood: [[log-likelihood, greedy]]
                    assert float(x[0][0]) == pytest.approx(float(y[0][0]), rel=1e-6) and x[0][1] == y[0][1]
                else:  # generate_until: [text]
                    assert x == y
        else:
            ja, jb = (json.load(open(f))["results"] for f in (a, b))
            assert ja == jb
