"""Host offload (`optim.offload`, `model.remat="offload"`): the same training run as without offload, bitwise (XLA:CPU
places every memory kind in the same RAM and drops the transfers, so the programs compute the same arithmetic in
the same order), with the offloaded state in pinned host memory between steps (its shardings say so) and on the
device only inside the step; checkpoints move between offload settings; the report splits device and host bytes."""
import jax
import numpy as np
import pytest

from helpers import VOCAB, batch, place, steps_for, tiny_config

BATCHES = [batch(16, 16, VOCAB, seed=i) for i in range(3)]
# (data, tensor, stage), schedule, ZeRO stage, microbatches: the layouts the issue names
# and a mixture of experts (llama family) at (data 2, expert 4) with the choice bias, ZeRO 2
LAYOUTS = {"2x2x2-1f1b-z1": ((2, 2, 2), "1f1b", 1, 4), "4x2x1-z3": ((4, 2, 1), "gpipe", 3, 2),
           "moe-e4-z2": ((2, 1, 1), "gpipe", 2, 2)}
MOE = {"model.arch": "llama", "model.kv_heads": 4, "model.experts": 8, "model.experts_per_token": 2,
       "model.expert_mlp": 32, "model.aux_loss": 0.01, "model.router_bias_rate": 0.01, "mesh.expert": 4}


def layout_config(name, offload="none", **over):
    (d, t, s), sched, zero, M = LAYOUTS[name]
    return tiny_config(**{"mesh.data": d, "mesh.tensor": t, "mesh.stage": s, "pipeline.schedule": sched,
                          "optim.zero_stage": zero, "train.microbatches": M, "optim.offload": offload,
                          **(MOE if name.startswith("moe") else {}), **over})


def kinds(tree) -> set:
    return {a.sharding.memory_kind for a in jax.tree.leaves(tree)}


def train(config, batches=BATCHES):
    """(losses, final state on the host, the steps) after one step per batch."""
    st = steps_for(config, VOCAB)
    state, losses = st.init(0), []
    for b in batches:
        state, m = st.train(state, place(st, b))
        losses.append(float(m["loss"]))
    return losses, state, st


_NONE = {}


def no_offload(name):
    if name not in _NONE:
        losses, state, _ = train(layout_config(name))
        _NONE[name] = losses, jax.device_get(state)
    return _NONE[name]


@pytest.mark.parametrize("name,offload", [(n, o) for n in LAYOUTS for o in ("optimizer", "params")
                                          if not (n.startswith("moe") and o == "optimizer")])
def test_offload_equals_no_offload_bitwise(name, offload):
    losses, state, st = train(layout_config(name, offload))
    ref_losses, ref_state = no_offload(name)
    assert losses == ref_losses
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), ref_state)
    # between steps the offloaded groups are in pinned host memory, the rest on the device
    assert kinds(state["opt_state"]) == {"pinned_host"}
    assert kinds(state["params"]) == ({"pinned_host"} if offload == "params" else {"device"})
    assert kinds({k: v for k, v in state.items() if k not in ("params", "opt_state")}) == {"device"}


def test_the_step_moves_the_offloaded_state_to_the_device_and_back():
    """The compiled program takes the Adam moments in pinned host memory and gives them back there; inside, it moves
    them to the device (XLA's placement annotations): on a GPU they occupy device memory only during the step."""
    st = steps_for(layout_config("4x2x1-z3", "optimizer"), VOCAB)
    abstract = st.abstract_state()
    text = st.train.lower(abstract, {"tokens": jax.ShapeDtypeStruct((16, 17), np.int32,
                                                                    sharding=st.batch_sharding)}).as_text()
    main = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
    n_opt = len(jax.tree.leaves(abstract["opt_state"]))
    assert main.count('mhlo.memory_kind = "pinned_host"') == 2 * n_opt  # every leaf in and out
    assert text.count('_xla_buffer_placement = "device"') >= n_opt


@pytest.mark.parametrize("saved,restored", [("optimizer", "none"), ("none", "params")])
def test_a_checkpoint_moves_between_offload_settings(tmp_path, saved, restored):
    """2 steps with one setting, a checkpoint, the third step with the other: the uninterrupted run, bitwise."""
    from jaxpar.state.checkpoint import Checkpointer
    _, state, st = train(layout_config("2x2x2-1f1b-z1", saved), BATCHES[:2])
    with Checkpointer(str(tmp_path), 1, 1, async_save=False) as ck:
        ck.save(2, st.to_canonical(state), {"step": 2}, force=True)
        st2 = steps_for(layout_config("2x2x2-1f1b-z1", restored), VOCAB)
        state2, _ = ck.restore(2, st2.abstract_state())
    state2 = st2.from_canonical(state2)
    assert kinds(state2["opt_state"]) == ({"device"} if restored == "none" else {"pinned_host"})
    state2, m = st2.train(state2, place(st2, BATCHES[2]))
    ref_losses, ref_state = no_offload("2x2x2-1f1b-z1")
    assert float(m["loss"]) == ref_losses[2]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state2["params"]), ref_state["params"])


def test_remat_offload_equals_selective_in_loss_and_gradients():
    """`model.remat="offload"` keeps the residuals `selective` keeps, in host memory: the same loss and gradients
    (bitwise on XLA:CPU, which drops the transfers; the recompute is the same)."""
    out = {}
    for remat in ("selective", "offload"):
        st = steps_for(layout_config("4x2x1-z3", **{"model.remat": remat}), VOCAB)
        out[remat] = jax.device_get(st.grads(st.init(0)["params"], place(st, BATCHES[0])))
    assert out["offload"][0] == out["selective"][0]
    jax.tree.map(np.testing.assert_array_equal, out["offload"][1], out["selective"][1])


def test_llama3_8b_dry_run_device_bytes_drop_by_the_optimizer_state():
    """`configs/llama3_8b.py` (tensor 8, float32 weights) on 8 fake devices: with `optim.offload=optimizer` the device
    bytes drop by AdamW's two float32 moments of this device's shard, 2 x 4 B x params / 8 (the norms, replicated,
    are 0.003 % of the params), within 5 %, and the host bytes are those moments."""
    import importlib.util

    from helpers import ROOT
    from jaxpar import model as gpt
    from jaxpar.compiled import report_for
    spec = importlib.util.spec_from_file_location("llama3_8b", f"{ROOT}/configs/llama3_8b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    reps = {}
    for offload in ("none", "optimizer"):
        c = mod.get_config()
        c.optim.offload = offload
        reps[offload] = report_for(c, vocab=128256)
    n = gpt.param_counts(gpt.config_from(mod.get_config(), 128256, 8))["total"]
    formula = 2 * 4 * n / 8
    saved = reps["none"]["placement"]["device"] - reps["optimizer"]["placement"]["device"]
    assert abs(saved / formula - 1) < 0.05, (saved, formula)
    assert abs(reps["optimizer"]["placement"]["host"] / formula - 1) < 0.05
    assert reps["none"]["placement"]["host"] == 0


def test_the_planner_ranks_offloaded_layouts_for_a_model_that_fits_only_with_them():
    """Mixtral 8x7B (bfloat16, 46.7B params) on 8 x A100 80 GB: params, float32 gradients and AdamW's moments alone
    exceed 72 GiB on every layout without offload; with `optim.offload=optimizer` the planner compiles the best,
    which fits, and prices the host link: 2 x the host bytes / 25 GB/s (PCIe Gen4, `hardware.HOST_LINKS`)."""
    import importlib.util

    from helpers import ROOT
    from jaxpar import plan as planner
    from jaxpar.plan import hardware
    from jaxpar.plan.space import Space
    spec = importlib.util.spec_from_file_location("mixtral_8x7b", f"{ROOT}/configs/mixtral_8x7b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    space = Space(tensor=(1,), stage=(1,), expert=(8,), zero=(2,), remat=("full",))
    p = planner.plan(mod.get_config(), hardware.cluster("a100-80g", 8), space, compile_top=1, devices=jax.devices())
    kept = [c for c in p.ranked if c.layout.offload == "none"]
    assert kept and all(c.fits(p.capacity) is False for c in kept)
    best = p.ranked[0]
    assert best.layout.offload != "none" and best.memory["source"] == "compiled" and best.fits(p.capacity)
    host = best.memory["host"]
    assert abs(p.model.host_bytes(best.layout) / host - 1) < 0.01  # the analytic host bytes: the compiled ones
    assert best.time["offload_s"] == pytest.approx(2 * (host / 25e9 + 10e-6), rel=0.01)
    assert best.memory["peak"] == best.memory["xla_peak"] - host
    # that layout is `configs/mixtral_8x7b.py`'s, whose --dry_run device bytes are this compile's: under 80 GB
    from jaxpar.layout import Layout
    assert best.layout == Layout.from_config(mod.get_config(), 8) and best.memory["peak"] < 80e9


def test_activation_offload_with_the_loop_engines_own_residuals_is_one_clear_error():
    from jaxpar.errors import ConfigError
    from jaxpar.validate import validate
    c = layout_config("2x2x2-1f1b-z1", **{"model.remat": "offload", "pipeline.remat": False})
    with pytest.raises(ConfigError, match=r"model.remat='offload' with pipeline.remat=False"):
        validate(c, 8)


def test_the_offload_bench_runs_and_reports_the_bytes_it_moves():
    """`bench/offload.py` at a tiny size (so that it cannot rot before a GPU runs it): every case computes the same
    loss; offloading moves exactly the host bytes off the device; params offload moves more than optimizer."""
    import json
    import os
    import subprocess
    import sys

    from helpers import ROOT
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "offload.py"), "--steps=1", "--embed=64",
                          "--layers=2", "--seq_len=32", "--batch=8", "--link_mb=1"],
                         capture_output=True, text=True, check=True, env=dict(os.environ), timeout=300).stdout
    got = json.loads(out[out.index("{"):])
    rows = {(r["offload"], r["remat"]): r for r in got["rows"]}
    assert got["same_loss"] and len(rows) == 4
    opt, params = rows[("optimizer", "selective")], rows[("params", "selective")]
    assert opt["device_bytes_saved"] == opt["host_bytes"] > 0 and params["host_bytes"] > opt["host_bytes"]
    assert got["host_link"]["to_device_gb_s"] > 0
