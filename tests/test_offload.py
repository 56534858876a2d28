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
LAYOUTS = {"2x2x2-1f1b-z1": ((2, 2, 2), "1f1b", 1, 4), "4x2x1-z3": ((4, 2, 1), "gpipe", 3, 2)}


def layout_config(name, offload="none", **over):
    (d, t, s), sched, zero, M = LAYOUTS[name]
    return tiny_config(**{"mesh.data": d, "mesh.tensor": t, "mesh.stage": s, "pipeline.schedule": sched,
                          "optim.zero_stage": zero, "train.microbatches": M, "optim.offload": offload, **over})


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


@pytest.mark.parametrize("offload", ["optimizer", "params"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_offload_equals_no_offload_bitwise(name, offload):
    losses, state, st = train(layout_config(name, offload))
    ref_losses, ref_state = no_offload(name)
    assert losses == ref_losses
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), ref_state)
    # between steps the offloaded groups are in pinned host memory, the rest on the device
    assert kinds(state["opt_state"]) == {"pinned_host"}
    assert kinds(state["params"]) == ({"pinned_host"} if offload == "params" else {"device"})
    assert kinds({k: v for k, v in state.items() if k not in ("params", "opt_state")}) == {"device"}
