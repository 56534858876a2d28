"""The engine on several processes as several hosts run it: GRPO, `python -m jaxpar.generate` and `python -m
jaxpar.evaluate` started by `python -m jaxpar.launch` as 2 processes x 4 CPU devices against 1 process x 8 devices, on (data, tensor) = (4, 2) (data spans the processes), in float64 (the comparison
after optimizer steps is then free of the summation order of the collectives). Every process takes part in each
round: the engine runs on the global mesh, each process scores its share of the round's groups and the scores and
what the reward functions logged are gathered, so the advantages and the metrics are the one-process values; the
completions JSONL and the metrics are written once (process 0); a kill inside a round resumes exactly on several
processes (`tests/test_slurm.py`, through SLURM). Generation and evaluation write their outputs once, in input order,
equal to one process's; an interrupted generation resumes."""
import json
import os
import sys

import pytest

from rl_runs import assert_same_grpo_run, grpo_completions, grpo_metrics

pytestmark = [pytest.mark.serial, pytest.mark.xdist_group("processes"), pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
@pytest.fixture(scope="module")
def runs(grpo_reference):
    """The GRPO run of `helpers.grpo_material` on 1 x 8 devices (conftest's `grpo_reference`) and on 2 x 4."""
    root, env = grpo_reference
    run(root, "two", 2, env)
    return root, env


def run(root, name, processes, env):
    import subprocess

    args = [os.path.join(ROOT, "train.py"), "--config", str(root / "config.py"), "--workdir", str(root / name)]
    launcher = [sys.executable, "-m", "jaxpar.launch", "--num_processes", "2", "--devices_per_process", "4", "--"]
    res = subprocess.run((launcher if processes > 1 else [sys.executable]) + args, env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_two_processes_run_grpo_like_one(runs):
    """The metrics of every log step equal (rewards, lengths and what reward functions logged exactly; the losses
    and lm-eval's task at the last step, `eval.tasks`, within 1e-9); the completions logged once, in order, equal,
    each scored by the process whose share it is; one lm-eval results file."""
    root, _ = runs
    assert_same_grpo_run(grpo_metrics(root / "two"), grpo_metrics(root / "one"))
    assert "eval/jaxpar_mc/acc" in grpo_metrics(root / "two")[4] and os.listdir(root / "two" / "lm_eval") == [
        "step_4.json"]
    two, one = grpo_completions(root / "two"), grpo_completions(root / "one")
    assert [r["process"] for r in two] == [0] * 8 + [1] * 8 + [0] * 8 + [1] * 8  # (2 logged rounds of 16)
    assert [r["process"] for r in one] == [0] * 32
    strip = lambda rows: [{k: v for k, v in r.items() if k != "process"} for r in rows]  # noqa: E731
    assert strip(two) == strip(one)


LAUNCH = [sys.executable, "-m", "jaxpar.launch", "--num_processes", "2", "--devices_per_process", "4", "--"]
LAYOUT = ["--config.mesh.data=4", "--config.mesh.tensor=2"]


def launched(*args, env=None):
    import subprocess

    from jaxpar import launch

    res = subprocess.run(LAUNCH + list(args), env=env or launch.cpu_env(os.environ, 8), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def test_an_interrupted_generation_finished_on_two_processes_writes_one_process_output_once(runs, tmp_path):
    """10 prompts x 2 samples at temperature 1 from the 2-process GRPO run's checkpoint (float64) on (data 4,
    tensor 2): written by 1 process, then cut to its first 4 records (an interrupted generation) and finished on 2
    processes, the file equals the 1-process file line for line (tokens and log-probs), written once, in order."""
    import jax

    from jaxpar.generate.__main__ import main

    root, env = runs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(10)))
    args = lambda out: ["--model", str(root / "two"), "--prompts", str(prompts), "--out", str(out),  # noqa: E731
                        "--max_new_tokens", "8", "--temperature", "1", "--n", "2", "--slots", "8", "--progress", "0",
                        *LAYOUT]
    with jax.enable_x64(True):
        assert main(args(tmp_path / "one.jsonl")) == 0
    one = (tmp_path / "one.jsonl").read_text().splitlines()
    (tmp_path / "two.jsonl").write_text("\n".join(one[:4]) + "\n")
    out = launched("-m", "jaxpar.generate", *args(tmp_path / "two.jsonl"), env=env)
    assert out.count("6 records (4 already in") == 1  # (process 0 alone reports and writes)
    assert (tmp_path / "two.jsonl").read_text().splitlines() == one and len(one) == 10


def test_evaluation_on_two_processes_gives_one_process_results_written_once(runs, tmp_path):
    """lm-eval's multiple-choice task on (data 4, tensor 2): the 2-process samples (each request's log-likelihood
    within 1e-6, its greedy flag equal) and metrics equal the 1-process run's; one results file, one table. (Its
    generation requests run on the engine that the generation test checks.)"""
    import glob

    from jaxpar.evaluate.__main__ import main

    root, _ = runs
    args = lambda out: ["--model", f"hf:{root}/base", "--tasks", "jaxpar_mc", "--include_path",  # noqa: E731
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
    assert len(files["one"]) == len(files["two"]) == 2
    for a, b in zip(files["one"], files["two"]):
        if "samples_" in a:
            ra, rb = ([json.loads(line)["resps"] for line in open(f)] for f in (a, b))
            assert len(ra) == len(rb) and all(len(x) == len(y) for x, y in zip(ra, rb))
            for x, y in ((x, y) for sa, sb in zip(ra, rb) for x, y in zip(sa, sb)):  # [[log-likelihood, greedy]]
                assert float(x[0][0]) == pytest.approx(float(y[0][0]), rel=1e-6) and x[0][1] == y[0][1]
        else:
            ja, jb = (json.load(open(f))["results"] for f in (a, b))
            assert ja == jb
