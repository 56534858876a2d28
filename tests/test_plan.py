"""The layout planner (jaxpar/plan): its enumeration against `validate`, its compiled memory against `--dry_run`,
its time model's monotonicity, and its fit to Narayanan et al. 2021, Table 1 (analytic; the compiles of that table
are bench/plan_published.py's)."""
import copy
import importlib.util
import dataclasses
import itertools
import json
import subprocess
import sys
import types
from pathlib import Path

import jax
import pytest

from helpers import tiny_config
from jaxpar import config as jcfg
from jaxpar.validate import validate
from jaxpar import plan as planner
from jaxpar import model as gpt
from jaxpar import trainer
from jaxpar.plan import cost, hardware, memory, target
from jaxpar.plan.space import Layout, Space, apply, candidates, set_layout
from jaxpar.parallel.pipeline.registry import NAMES
from jaxpar.train.step import model_config

ROOT = Path(__file__).resolve().parent.parent


def small():
    return tiny_config(**{"model.vocab_size": 256, "train.global_batch_size": 8, "model.layers": 4,
                          "model.heads": 4})


def canonical(lay: Layout) -> bool:
    """The planner's documented reductions (jaxpar/plan/space.py): one stage has no schedule (gpipe, v 1, stage
    recompute flag True); a pipeline recomputes either its stages (pipeline.remat, model.remat none) or, with 1F1B's
    kept residuals (pipeline.remat False), by model.remat; v > 1 only for the interleaved schedules, and circular
    with v = 1 is GPipe."""
    if lay.stage == 1:
        return (lay.schedule, lay.virtual_stages, lay.pipeline_remat) == ("gpipe", 1, True)
    if lay.pipeline_remat and lay.remat != "none":
        return False
    if not lay.pipeline_remat and lay.schedule != "1f1b":
        return False
    if lay.schedule == "circular":
        return lay.virtual_stages > 1
    return lay.virtual_stages == 1 or lay.schedule == "1f1b"


def test_enumeration_is_exactly_what_validate_accepts():
    c, space = small(), Space(zero=(0, 3), remat=("none", "full"), max_micro_batch=8, offload=("none",),
                             context=(1,))
    found = set(candidates(c, 8, space))
    brute, work = set(), copy.deepcopy(c)
    for t, s, M, sched, v, z, r, pr, sp in itertools.product(
            (1, 2, 4, 8), (1, 2, 4, 8), range(1, 9), NAMES, (1, 2, 4), (0, 3), ("none", "full"), (True, False),
            (False, True)):
        if 8 % (t * s) or (t == 1 and sp):
            continue
        lay = Layout(8 // (t * s), t, s, M, sched, v, z, r, pr, sp)
        try:
            set_layout(work, lay)
            validate(work, 8)
        except jcfg.ConfigError:
            continue
        if canonical(lay):
            brute.add(lay)
    assert found == brute and len(found) > 100


@pytest.mark.slow
def test_compiled_memory_equals_dry_run(tmp_path):
    """ZeRO 0 at data 4 is compiled at data 2 (same per-device program): equal to --dry_run's compile at data 4;
    ZeRO 1 is compiled at its own data size."""
    import jax

    c = small()
    comp = memory.Compiler(c, 256, jax.devices())
    for lay in (Layout(4, 2, 1, 1, zero_stage=0), Layout(2, 2, 2, 2, "1f1b", zero_stage=1)):
        got = comp.memory(lay)
        assert got["source"] == ("derived (data 2)" if lay.zero_stage == 0 else "compiled")
        rep = trainer.dry_run(apply(c, lay), str(tmp_path / lay.name().replace(" ", "_")))
        assert {k: got[k] for k in rep["memory"]} == rep["memory"], lay
    assert comp.compiles == 2


def _fast(cl: hardware.Cluster, k: float) -> hardware.Cluster:
    scale = lambda link: dataclasses.replace(link, busbw=link.busbw * k)
    return dataclasses.replace(cl, intra=scale(cl.intra), inter=scale(cl.inter))


def test_time_model_monotone():
    c = tiny_config(**{"model.vocab_size": 51200, "model.seq_len": 1024, "model.layers": 24, "model.embed": 2048,
                       "model.heads": 16, "model.mlp": 0, "train.global_batch_size": 64,
                       "train.compute_dtype": "bfloat16"})
    m = cost.Model.from_config(c, 51200)
    cl = hardware.cluster("a100-80g", 64, 8, "ib-hdr")
    lays = list(candidates(c, 64, Space(zero=(0, 2, 3), remat=("none", "full"), max_micro_batch=4)))
    assert len(lays) > 200
    for lay in lays:  # more bandwidth is never slower
        t = [cost.step_time(m, lay, _fast(cl, k))["step_s"] for k in (0.5, 1.0, 2.0, 8.0)]
        assert all(a >= b for a, b in zip(t, t[1:])), (lay, t)
    for sched, v in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("1f1b", 2), ("zb_h1", 1)):
        for S in (2, 4):  # more microbatches (same micro batch) never a bigger bubble fraction
            frac = []
            for M in (4, 8, 16, 32):
                cm = dataclasses.replace(m, global_batch=M * 2)
                r = cost.step_time(cm, Layout(64 // (8 * S), 8, S, M, sched, v), cl)
                frac.append(r["bubble_s"] / (r["compute_s"] + r["bubble_s"]))
            assert all(a >= b - 1e-12 for a, b in zip(frac, frac[1:])), (sched, v, S, frac)
            assert frac[-1] < frac[0]


def test_narayanan_table1_within_15_percent():
    """Predicted TFLOP/s per GPU (the paper's FLOP count) within 15 % of every row, the planner choosing the
    microbatch and interleaving (analytic only: memory is bench/plan_published.py's)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from plan_published import MEGATRON_2021, TABLE1, megatron_config

    for name, h, l, a, t, p, n, B, pub in TABLE1[:4]:  # 1T's 64-stage tick tables: the bench's
        pl = planner.plan(megatron_config(h, l, a, B), hardware.cluster("a100-80g", n),
                          Space(tensor=(t,), stage=(p,), schedule=("1f1b",) if p > 1 else None, **MEGATRON_2021))
        tf = cost.narayanan_flops(pl.model) / pl.ranked[0].time["step_s"] / n / 1e12
        assert abs(tf / pub - 1) < 0.15, (name, tf, pub)


def test_cli_json_and_bad_input(tmp_path):
    out = tmp_path / "plan.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "jaxpar.plan", "--config",
                                     str(ROOT / "configs" / "shakespeare.py"), "--nocompile", *a],
                                    capture_output=True, text=True, timeout=300, cwd=ROOT)
    r = run("--gpus", "8", "--json", str(out), "--top", "3")
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert rows and rows[0]["why"] == "best" and "--config.mesh.tensor=" in r.stdout
    assert [x["tokens_per_s"] for x in rows[:5]] == sorted([x["tokens_per_s"] for x in rows[:5]], reverse=True)
    r = run("--gpus", "8", "--device", "tpu9")
    assert r.returncode != 0 and "--device='tpu9'" in r.stderr + r.stdout


@pytest.mark.slow
def test_data_parallel_bytes_match_the_compile():
    """The analytic ZeRO traffic (cost._data_parallel) against the compiled step's collectives over `data` (replica
    groups mapped to mesh axes): within 3 % (the analytic count leaves out norms and biases); ZeRO-3 within 10 % (the
    shared params are gathered once per step, not per layer). Tensor 1: with tensor > 1 jaxpar's ZeRO-2/3
    reduce-scatters move the tensor-gathered gradient (t x the bytes; README, known limits), which only the compiled
    figure shows."""
    import jax

    c = small()
    c.train.global_batch_size = 16
    m, cl = cost.Model.from_config(c, 256), hardware.cluster("a100-80g", 8)
    comp = memory.Compiler(c, 256, jax.devices())
    for lay, tol in ((Layout(8, 1, 1, 2, zero_stage=0), 0.03), (Layout(8, 1, 1, 2, zero_stage=2), 0.03),
                     (Layout(8, 1, 1, 2, zero_stage=3), 0.10),
                     (Layout(4, 1, 2, 2, "gpipe", zero_stage=2), 0.03)):
        compiled = comp.memory(lay)["data_collectives"]
        a, k = cost.step_time(m, lay, cl)["dp_bytes"], cost.step_time(m, lay, cl, compiled)["dp_bytes"]
        assert abs(k / a - 1) < tol, (lay, a, k)
        assert {kind for kind, _, _ in compiled} >= ({"all-gather"} if lay.zero_stage else {"all-reduce"})


@pytest.mark.parametrize("name", ["shakespeare", "llama3_8b"])
def test_planner_counts_and_flops_are_the_trainers(name):
    """One model spec: the planner's parameter count, FLOPs per token and vocabulary are what the trainer builds
    (abstract shapes; the byte tokenizer has 256 ids everywhere)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config()
    vocab = planner.vocab_of(config)
    assert vocab == (256 if name == "shakespeare" else 128256)
    model = cost.Model.from_config(config, vocab)
    built = model_config(config, vocab, int(config.mesh.tensor))  # what trainer.run builds for this config
    shapes = jax.eval_shape(lambda: gpt.init_params(built, jax.random.key(0)))
    assert model.params == sum(a.size for a in jax.tree.leaves(shapes))
    assert model.flops_per_token == gpt.flops_per_token(built)
    assert cost.model_flops_per_step(model) == gpt.flops_per_token(built) * model.global_batch * model.seq


def test_why_it_loses_agrees_with_the_ranking():
    """A faster row ranked below the best because its fit is unknown is explained by that rule (no `+-`); a slower
    one by the term that costs it most, with a signed step difference."""
    from jaxpar.plan import Candidate
    from jaxpar.plan.table import why

    terms = dict.fromkeys(("bubble_s", "tp_comm_s", "pp_comm_s", "ep_comm_s", "cp_comm_s", "dp_comm_s",
                           "recompute_s", "optimizer_s", "offload_s"), 0.0)
    time = lambda step, dp=0.0: {**terms, "dp_comm_s": dp, "compute_s": 1.0, "step_s": step}  # noqa: E731
    plan = types.SimpleNamespace(capacity=80 * 2**30)
    best = Candidate(None, time(3.0), (1, 1), {"peak": 70 * 2**30})
    unknown = Candidate(None, time(1.28), (40 * 2**30, 20 * 2**30))
    slower = Candidate(None, time(3.5, dp=0.5), (1, 1), {"peak": 60 * 2**30})
    assert why(plan, best, best) == "best"
    said = why(plan, unknown, best)
    assert said.startswith("1.72 s faster, not compiled: its fit is unknown (estimate 60.0 GiB)") and "+-" not in said
    assert why(plan, slower, best) == "data-parallel/ZeRO comm +0.5 s (step +0.5 s)"


@pytest.mark.parametrize("impl,factor", [("buffers", 0.0), ("ragged", 0.0), ("ragged", 1.5)])
def test_the_moe_rows_the_planner_prices(impl, factor):
    """A MoE layer per sequence on one device (seq 64, 8 experts, k 2, capacity factor 1.25, expert 4): `buffers`
    computes, holds and sends E·C slots (C = ceil(1.25 x 64 x 2 / 8) = 20); `ragged` computes and sends its k·s
    choices (the GPU's `ragged_all_to_all` moves the rows alone) into a receive buffer of `mesh.expert` x k·s rows,
    or `expert_buffer_factor` x k·s; the all-to-all bytes of the layer's time follow the rows sent; `ragged`'s weight
    gradient is priced over E x its rows (XLA:GPU's expansion of a ragged contraction)."""
    over = {"model.arch": "llama", "model.seq_len": 64, "model.experts": 8, "model.experts_per_token": 2,
            "model.expert_mlp": 32, "model.capacity_factor": 1.25, "model.moe_impl": impl, "mesh.expert": 4,
            "mesh.data": 2, "model.expert_buffer_factor": factor}
    c = tiny_config(**over)
    from jaxpar.layout import Layout as MeshLayout

    m, lay = cost.Model.from_config(c, 256), MeshLayout.from_config(c, 8)
    want = {"buffers": (160, 160, 160), "ragged": (128, 4 * 128 if not factor else 1.5 * 128, 128)}[impl]
    assert cost.expert_rows(m, lay) == want
    assert cost.weight_grad_rows(m, lay) == (8 * 128 if impl == "ragged" else 160)
    cl = hardware.cluster("h100", 8)
    more = dataclasses.replace(m, top_k=4) if impl == "ragged" else dataclasses.replace(m, capacity=40)
    assert cost._layer(more, lay, cl).ep > cost._layer(m, lay, cl).ep  # more rows sent, more all-to-all time


# ---- model.moe_impl=auto: the implementation the cost model prices cheaper on the target (jaxpar/plan/target.py) --

H100S = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")] * 8  # the hardware said to be


def shipped(name: str, **over):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config()
    for k, v in over.items():
        section, key = k.split(".")
        config[section][key] = v
    return config


def priced(config, vocab: int, device: str) -> dict:
    """Each implementation's step seconds, by `cost.step_time` on a config naming it (not through `moe_prices`)."""
    lay = validate(config, 8)
    out = {}
    for impl in ("buffers", "ragged"):
        c = copy.deepcopy(config)
        c.model.moe_impl = impl
        out[impl] = cost.step_time(cost.Model.from_config(c, vocab), lay, hardware.cluster(device, 8))["step_s"]
    return out


@pytest.mark.parametrize("name,factor", [("qwen3_30b_a3b", 1.25), ("qwen3_30b_a3b", 0.0), ("mixtral_8x7b", 1.25)])
def test_auto_is_the_cheaper_priced_the_same_on_a_cpu_host_planning_for_h100s_as_on_h100s(name, factor):
    """configs/qwen3_30b_a3b.py and configs/mixtral_8x7b.py (as shipped; Qwen3 also dropless, where the cost model
    prices the other implementation cheaper) on 8 x H100: `auto` resolves
    to the implementation `cost.step_time` prices cheaper, the same on this CPU host with `mesh.device=h100` as on
    devices whose `device_kind` says H100, and the planner ranks that layout with the same choice; on CPU devices
    without `mesh.device`, `buffers`."""
    config = shipped(name, **{"model.capacity_factor": factor})
    vocab = planner.vocab_of(config)
    times = priced(config, vocab, "h100")
    cheaper = min(times, key=times.get)
    lay = validate(config, 8)
    on_h100s = target.resolve(config, vocab, lay, H100S)
    config.mesh.device = "h100"
    planning = target.resolve(config, vocab, lay, jax.devices()[:8])
    for resolved, chose in (on_h100s, planning):
        assert resolved.model.moe_impl == chose["model.moe_impl"] == cheaper and chose["device"] == "h100"
        assert chose["prices"] == pytest.approx(times, rel=1e-12) and f"runs {cheaper} on 8 x h100" in chose["why"]
    assert on_h100s[1]["source"] == "the devices present" and planning[1]["source"] == "mesh.device"
    space = Space(tensor=(1,), stage=(1,), expert=(8,), context=(1,), zero=(2,), offload=(config.optim.offload,),
                  remat=("full",), sp=(False,))
    best = planner.plan(config, hardware.cluster("h100", 8), space).ranked[0]
    assert best.layout == lay and best.time["moe_impl"] == cheaper
    assert best.config(config).model.moe_impl == cheaper
    config.mesh.device = ""
    assert target.resolve(config, vocab, lay, jax.devices()[:8])[0].model.moe_impl == "buffers"


def test_auto_is_priced_with_the_grouped_kernel_the_target_runs():
    """Off Hopper (an A100) `ragged`'s grouped matmuls are XLA's ragged dot, expanded over every expert in the
    forward and input gradient too: Mixtral dropless costs E x its active rows there; on H100s the Mosaic kernel
    takes those two, and only the weight gradient is expanded."""
    config = shipped("mixtral_8x7b", **{"model.capacity_factor": 0.0})
    m, lay = cost.Model.from_config(config, 32000), validate(config, 8)
    m = dataclasses.replace(m, auto=False, ragged=True)
    assert not cost.ragged_expanded(m, hardware.cluster("h100", 8))
    assert cost.ragged_expanded(m, hardware.cluster("a100-80g", 8))
    assert not cost.ragged_expanded(dataclasses.replace(m, ragged=False), hardware.cluster("a100-80g", 8))
    assert cost.ragged_expanded(dataclasses.replace(m, compute_dtype="float32"), hardware.cluster("h100", 8))
    times = priced(config, 32000, "a100-80g")
    assert times["buffers"] < times["ragged"]


def test_a_dry_run_and_the_planner_for_h100s_on_this_host_compile_what_they_run(tmp_path, capsys):
    """`--dry_run --config.mesh.device=h100` on CPU devices: a tiny dropless MoE that the cost model prices cheaper
    with `ragged` on H100s (bfloat16, widths of 64: the Mosaic kernel's) is compiled as `ragged` (the model config
    the step was built from), and the dry run prints why; the planner for 8 x H100 compiles the same program (the
    same bytes)."""
    over = {"model.arch": "llama", "model.kv_heads": 4, "model.experts": 8, "model.experts_per_token": 2,
            "model.embed": 64, "model.expert_mlp": 64, "model.vocab_size": 256, "train.compute_dtype": "bfloat16",
            "mesh.data": 8, "train.global_batch_size": 8, "optim.zero_stage": 1, "mesh.device": "h100"}
    times = priced(tiny_config(**over), 256, "h100")
    assert min(times, key=times.get) == "ragged", f"pick a config the cost model prices ragged cheaper: {times}"
    rep = trainer.dry_run(tiny_config(**over), str(tmp_path))
    assert rep["layout"]["moe_impl"] == rep["resolved"]["model.moe_impl"] == "ragged"
    assert rep["resolved"]["prices"] == pytest.approx(times, rel=1e-12)
    said = capsys.readouterr().out
    assert f"model.moe_impl=auto runs ragged on 8 x h100 (mesh.device): the cost model prices ragged at " \
           f"{times['ragged']:.3g} s/step against buffers at {times['buffers']:.3g} s" in said
    on_disk = json.loads((tmp_path / "compile_report.json").read_text())
    assert on_disk["layout"]["moe_impl"] == "ragged" and on_disk["resolved"]["device"] == "h100"
    space = Space(tensor=(1,), stage=(1,), expert=(1,), context=(1,), zero=(1,), offload=("none",), remat=("none",),
                  sp=(False,))
    best = planner.plan(tiny_config(**over), hardware.cluster("h100", 8), space, compile_top=1,
                        devices=jax.devices()[:8]).ranked[0]
    assert best.time["moe_impl"] == "ragged" and best.memory["source"] == "compiled"
    assert best.memory["peak"] == rep["memory"]["peak"]


def test_device_kinds_name_the_planners_devices():
    """CUDA's device names of the parts the planner prices are its devices; other parts (their own peaks and
    bandwidths) are none of them."""
    named = {k: hardware.device_named(k) for k in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB",
                                                   "NVIDIA A100 80GB PCIe", "NVIDIA H100 PCIe", "NVIDIA H200 NVL",
                                                   "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-40GB", "cpu")}
    assert named == {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100-80g",
                     "NVIDIA A100 80GB PCIe": "a100-80g-pcie", "NVIDIA H100 PCIe": None, "NVIDIA H200 NVL": None,
                     "NVIDIA GH200 480GB": None, "NVIDIA A100-SXM4-40GB": None, "cpu": None}


@pytest.mark.parametrize("over,devices,match", [
    ({"mesh.device": "h800"}, None, r"mesh.device='h800' is not a device jaxpar/plan/hardware.py prices; pick one "
                                    r"of \['a100-80g', 'a100-80g-pcie', 'h100', 'h200'\]"),
    ({}, [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA L40S")] * 8,
     r"does not know 'NVIDIA L40S'; set --config.mesh.device to the nearest of .* or model.moe_impl to 'buffers' "
     r"or 'ragged'"),
    ({"model.grouped_matmul": "mosaic", "train.compute_dtype": "bfloat16", "model.embed": 64, "model.expert_mlp": 64},
     None, r"runs buffers on CPU devices .*; then: model.grouped_matmul='mosaic' "
                                               r"runs `ragged`'s grouped matmuls, but model.moe_impl='buffers' runs"),
    ({"mesh.expert": 4, "mesh.data": 2, "model.expert_buffer_factor": 1.5}, None,
     r"runs buffers on CPU devices .*; then: model.expert_buffer_factor=1.5 bounds the rows `ragged` sends"),
])
def test_auto_that_cannot_be_resolved_is_one_clear_error(over, devices, match):
    c = tiny_config(**{"model.arch": "llama", "model.kv_heads": 4, "model.experts": 8, "model.experts_per_token": 2,
                       "model.expert_mlp": 32, **over})
    with pytest.raises(jcfg.ConfigError, match=match):
        target.resolve(c, 256, validate(c, 8), devices or jax.devices()[:8])

