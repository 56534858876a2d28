"""A row continued in its slot after a turn (`Engine.generate(turns=)`: a tool's result prefilled after the row's own
tokens, `Decoder.extend`): what it samples next equals a fresh prefill of the whole exchange (the prompt, its tokens
and the given ids as one prompt: tokens equal, log-probs within 1e-6), on the paged and the dense cache; the given ids
are the ones given (never re-encoded), masked out (`tool_mask`) and counted in the budget, which ends a row whose
turn would pass it without them (TRL's rollback)."""
import dataclasses

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tiny_checkpoints  # noqa: E402
from tiny_checkpoints import V  # noqa: E402
from jaxpar.formats import hf  # noqa: E402
from jaxpar.generate.engine import Engine, Request  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_paged")
STOPS = tuple(range(1, V, 4))  # a quarter of the vocabulary ends a turn: rows stop within a few tokens


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 in float64 (run under `jax.enable_x64`): the continued row and the fresh prefill sum in other
    orders (a decode step's attention over the cache, a prefill's over its positions), so a float32 comparison would
    measure the rounding; the log-probs come back float32 either way."""
    fwd, params, _ = hf.load(str(tiny_checkpoints.save(tmp_path_factory, ("qwen3",))["qwen3"][1]))
    cfg = dataclasses.replace(fwd.cfg, compute_dtype="float64", param_dtype="float64")
    with jax.enable_x64(True):
        return type(fwd)(cfg), jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def given(i: int, turn: int) -> list:
    """The ids turn `turn` of request i gives (a tool result of its own length), none after the second."""
    return [] if turn >= 2 else [int(x) for x in np.random.default_rng(100 * i + turn).integers(2, V, 3 + 5 * i % 7)]


@pytest.mark.parametrize("kv_block", [16, 0])
def test_a_row_continued_after_a_turn_samples_what_a_fresh_prefill_of_the_exchange_does(qwen3, kv_block):
    with jax.enable_x64(True):
        continued_rows(*qwen3, kv_block)


def continued_rows(fwd, params, kv_block: int):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, V, rng.integers(2, 30)).tolist() for _ in range(6)]
    reqs = [Request(p, max_new_tokens=48, stop_ids=STOPS, seed=i, stream=i) for i, p in enumerate(prompts)]
    asked = {}

    def turns(i, tokens):
        turn = asked.setdefault(i, [])
        turn.append(len(tokens))
        return given(i, len(turn) - 1)

    engine = Engine(fwd, params, slots=4, kv_block=kv_block)
    got = engine.generate(reqs, turns=turns)
    fresh = Engine(fwd, params, slots=4, kv_block=kv_block)
    continued = 0
    for i, (r, c) in enumerate(zip(reqs, got)):
        budget = min(r.max_new_tokens, fwd.cfg.max_positions + 1 - len(r.prompt))  # (the engine's: its context)
        assert len(c.tokens) == len(c.tool_mask) == len(c.logprobs) <= budget
        at = 0  # where each turn's ids start in the completion
        for turn, stop in enumerate(asked.get(i, [])):
            ids = given(i, turn)
            if not ids or stop + len(ids) > budget:
                assert len(c.tokens) == stop  # (no turn, or rolled back: the row ends on its stop id)
                break
            assert c.tokens[stop:stop + len(ids)] == ids and c.tool_mask[stop:stop + len(ids)] == [0] * len(ids)
            assert c.tool_mask[at:stop] == [1] * (stop - at) and c.tokens[stop - 1] in STOPS
            at = stop + len(ids)
            if at == budget:
                break
            want = fresh.generate([Request(r.prompt + c.tokens[:at], max_new_tokens=budget - at,
                                           stop_ids=STOPS)])[0]
            n = len(want.tokens)
            assert c.tokens[at:at + n] == want.tokens, (i, turn)
            np.testing.assert_allclose(c.model_logprobs[at:at + n], want.model_logprobs, atol=1e-6)
            continued += 1
    assert continued >= 6 and engine.stats["prefill_tokens"] > sum(map(len, prompts))


def test_a_turn_past_the_budget_ends_the_row_without_it(qwen3):
    with jax.enable_x64(True):
        past_the_budget(*qwen3)


def past_the_budget(fwd, params):
    req = Request([5, 6, 7], max_new_tokens=6, stop_ids=STOPS)
    plain = Engine(fwd, params, slots=2).generate([req])[0]
    assert plain.finish_reason == "stop" and len(plain.tokens) < 6
    room = 6 - len(plain.tokens)
    over = Engine(fwd, params, slots=2).generate([req], turns=lambda i, t: [9] * (room + 1))[0]
    assert over.tokens == plain.tokens and over.tool_mask == [1] * len(plain.tokens)
    exact = Engine(fwd, params, slots=2).generate(  # (ids as an array, as `ChatFormat.tool_suffix` gives them)
        [req], turns=lambda i, t: np.full(room, 9) if len(t) < 6 else None)[0]
    assert exact.tokens == plain.tokens + [9] * room and exact.finish_reason == "length"

    # the context as TRL's max_model_len: prompt + completion + the ids must stay short of it
    C, rng = fwd.cfg.max_positions, np.random.default_rng(1)
    nears = [Request(rng.integers(2, V, C - 12).tolist(), max_new_tokens=100, stop_ids=STOPS) for _ in range(8)]
    near, plain = next((r, c) for r, c in zip(nears, Engine(fwd, params, slots=8).generate(nears))
                       if c.finish_reason == "stop" and len(c.tokens) <= 8)  # (a stop with room left)
    room = C - 1 - len(near.prompt) - len(plain.tokens)
    over = Engine(fwd, params, slots=2).generate([near], turns=lambda i, t: [9] * (room + 1))[0]
    assert over.tokens == plain.tokens
    kept = Engine(fwd, params, slots=2).generate([near], turns=lambda i, t: [9] * room if len(t) < 9 else None)[0]
    assert kept.tokens[:len(plain.tokens) + room] == plain.tokens + [9] * room
