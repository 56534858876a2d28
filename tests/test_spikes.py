"""Loss-spike skipping (`train.skip_spikes`, `jaxpar/train/spikes.py`): the rule against hand-computed statistics, an
injected spike batch skipped so that the run equals the run without it, bitwise, and a run resumed inside the window
deciding as the uninterrupted one; bad settings are one clear error each."""
import jax
import numpy as np
import pytest

from helpers import VOCAB, batch, place, steps_for, tiny_config
from jaxpar.train import spikes
from jaxpar.state.checkpoint import Checkpointer
from jaxpar.errors import ConfigError
from jaxpar.validate import validate

# a batch the model learns within a few steps (each row counts up), and a spike: random tokens, far above the
# learned batch's loss once the window holds only learned steps
PATTERN = {"tokens": np.tile((np.arange(17, dtype=np.int32) * 7) % VOCAB, (16, 1))}
SPIKE = batch(16, 16, VOCAB, seed=5)
N_WARM = 12


def config(**over):
    return tiny_config(**{"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "pipeline.schedule": "1f1b",
                          "train.microbatches": 2, "optim.lr": 1e-2, "train.skip_spikes": True,
                          "train.spike_window": 4, "train.spike_threshold": 4.0, **over})


def run(st, state, batches):
    out = []
    for b in batches:
        state, m = st.train(state, place(st, b))
        out.append((float(m["loss"]), int(m["skipped_spike"]), int(m["skipped"])))
    return state, out


def test_the_rule_against_the_window_by_hand():
    """Full window [1, 2, 3, 4]: mean 2.5, std sqrt(1.25) = 1.118; threshold 2 -> a loss above 4.736 is a spike."""
    s = spikes.init(4)
    for v in (1.0, 2.0, 3.0, 4.0):
        assert not bool(spikes.is_spike(s, {"loss": np.float32(100.0), "grad_norm": np.float32(0.0)}, 2.0))  # filling
        s = spikes.record(s, {"loss": np.float32(v), "grad_norm": np.float32(1.0)}, True, np.bool_(False), 1)
    is_spike = lambda loss, g=1.0: bool(spikes.is_spike(s, {"loss": np.float32(loss), "grad_norm": np.float32(g)}, 2.0))
    assert not is_spike(4.73) and is_spike(4.74) and is_spike(1.0, g=1.01) and not is_spike(np.inf)
    s2 = spikes.record(s, {"loss": np.float32(9.0), "grad_norm": np.float32(1.0)}, False, np.bool_(True), 7)
    assert np.array_equal(s2["loss"], s["loss"]) and int(s2["skipped"]) == 1 and int(s2["last"]) == 7
    r = spikes.resize(jax.device_get(s), 2)  # a smaller window keeps the latest steps
    assert r["loss"].tolist() == [3.0, 4.0] and int(r["count"]) == 2
    r = spikes.resize(jax.device_get(s), 6)
    assert r["loss"].tolist() == [0, 0, 1, 2, 3, 4] and int(r["count"]) == 4


def test_an_injected_spike_is_skipped_and_the_run_equals_the_run_without_it():
    """(2, 2, 2) 1F1B: 12 steps on the learned batch, the spike batch, 2 more: the spike's update is skipped
    (`skipped_spike`), nothing else is, and the params equal, bit for bit, the run that never saw that batch (the
    schedule counts applied updates; the window holds applied steps only)."""
    st = steps_for(config(), VOCAB)
    s_spike, got = run(st, st.init(0), [PATTERN] * N_WARM + [SPIKE] + [PATTERN] * 2)
    s_ref, ref = run(st, st.init(0), [PATTERN] * (N_WARM + 2))
    assert [g[1] for g in got] == [0] * N_WARM + [1, 0, 0] and [g[2] for g in got] == [g[1] for g in got]
    window = np.array([g[0] for g in got[N_WARM - 4:N_WARM]])  # the rule, recomputed from the logged losses
    assert got[N_WARM][0] > window.mean() + 4.0 * window.std()
    assert [g[0] for g in got[:N_WARM] + got[N_WARM + 1:]] == [r[0] for r in ref]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(s_spike["params"]), jax.device_get(s_ref["params"]))
    assert int(s_spike["spikes"]["skipped"]) == 1 and int(s_spike["spikes"]["last"]) == N_WARM + 1


def test_a_run_resumed_inside_the_window_decides_as_the_uninterrupted_one(tmp_path):
    """A checkpoint 2 steps before the spike (the window full of steps from before it), restored onto another layout
    (data 8): the spike is skipped there too, with the same statistics."""
    st = steps_for(config(), VOCAB)
    state, _ = run(st, st.init(0), [PATTERN] * (N_WARM - 2))
    with Checkpointer(str(tmp_path), 1, 1, async_save=False) as ck:
        ck.save(N_WARM - 2, st.to_canonical(state), {"step": N_WARM - 2}, force=True)
        st8 = steps_for(config(**{"mesh.data": 8, "mesh.tensor": 1, "mesh.stage": 1}), VOCAB)
        resumed, _ = ck.restore(N_WARM - 2, st8.abstract_state())
        wider, _ = ck.restore(N_WARM - 2, steps_for(config(**{"train.spike_window": 6}), VOCAB).abstract_state())
    # another window keeps the saved steps, the most recent last
    assert jax.device_get(wider["spikes"]["loss"])[2:].tolist() == jax.device_get(state["spikes"]["loss"]).tolist()
    assert int(wider["spikes"]["count"]) == 4
    np.testing.assert_array_equal(jax.device_get(resumed["spikes"]["loss"]), jax.device_get(state["spikes"]["loss"]))
    _, after = run(st8, st8.from_canonical(resumed), [PATTERN] * 2 + [SPIKE, PATTERN])
    _, uninterrupted = run(st, state, [PATTERN] * 2 + [SPIKE, PATTERN])
    assert [a[1] for a in after] == [a[1] for a in uninterrupted] == [0, 0, 1, 0]


@pytest.mark.parametrize("key,value,says", [("train.spike_window", 0, "an integer >= 1"),
                                            ("train.spike_threshold", 0.0, "a finite number > 0"),
                                            ("train.spike_threshold", -1.0, "a finite number > 0"),
                                            ("optim.offload", "cpu", "pick one of ('none', 'optimizer', 'params')"),
                                            ("model.remat", "host", "pick one of")])
def test_bad_spike_and_offload_settings_are_one_clear_error(key, value, says):
    with pytest.raises(ConfigError) as e:
        validate(tiny_config(**{key: value}), 8)
    line = next(ln for ln in str(e.value).splitlines() if f"{key}=" in ln)
    assert says in line
