"""The planner's price of a GRPO round (`jaxpar/plan/rollout.py`, `memory.Generation`): its KV pool and decode
params per layout against the bytes counted from the model's shape, its FLOPs against the engine's compiled programs,
its decode never faster than the HBM moves its bytes."""
import dataclasses
import importlib.util
from pathlib import Path

import jax
import pytest

from helpers import tiny_config
from jaxpar import model as gpt
from jaxpar import plan as planner
from jaxpar.plan import cost, hardware, memory, table
from jaxpar.plan.space import Layout, Space

ROOT = Path(__file__).resolve().parent.parent


def test_the_planner_prices_a_grpo_rounds_kv_pool():
    """GRPO of Qwen3-1.7B's shape (`configs/grpo_qwen3_1p7b_gsm8k.py`) planned for 8 x H100: every layout's round
    holds the paged pool of its 32 x 8 completions of 1,536 positions (96 blocks of 16 each; keys and values of 28
    layers x 8 KV heads x 128 in bf16), split over the rows' shards (data) and the KV heads' (tensor): the bytes
    counted here from the shape. A pool of 2 GiB a device holds what fits in 2 GiB; one of 100 GiB fits no layout,
    and the table says why."""
    spec = importlib.util.spec_from_file_location("grpo_cfg", ROOT / "configs" / "grpo_qwen3_1p7b_gsm8k.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    space = Space(tensor=(1, 2, 4), stage=(1, 2), expert=(1,), context=(1,), zero=(1, 3), offload=("none",),
                  remat=("full",), sp=(False,), schedule=("1f1b",))
    block_bytes, cluster = 2 * 28 * 16 * 8 * 128 * 2, hardware.cluster("h100", 8)
    p = planner.plan(mod.get_config(), cluster, space, compile_top=0)
    assert {c.layout.tensor for c in p.ranked} == {1, 2, 4} and {c.layout.stage for c in p.ranked} == {1, 2}
    price, held = {}, {}
    for c in p.ranked:
        g, lay, t = c.generation, c.layout, c.time
        assert g["kv_blocks"] == 256 * 96 and g["kv_bytes"] == 256 * 96 * block_bytes // (lay.data * lay.tensor)
        assert g["peak"] == g["kv_bytes"] + g["params_bytes"] and c.fits(p.capacity) is None
        # decode reads the weights and its rows' KV every step: never faster than the HBM moves them
        rows = 256 // lay.data
        read = g["params_bytes"] + rows * (512 + 512) * g["position_bytes"]
        assert t["round"]["decode_s"] >= 1024 * read / cluster.device.hbm_bw
        assert t["step_s"] == pytest.approx(t["train_s"] + t["round_s"])
        assert g["zero3_gathered"] == (lay.zero_stage == 3)
        price[(lay.data, lay.tensor, lay.stage, lay.zero_stage)] = t["round"]["decode_s"]
        held[(lay.data, lay.tensor, lay.stage)] = g["params_bytes"]  # (the same whole params at every ZeRO stage)
    for (d, t_, s_, z), v in price.items():  # ZeRO-3 gathered once a round: its decode reads what ZeRO-1's reads
        if z == 3 and (d, t_, s_, 1) in price:
            assert v == pytest.approx(price[(d, t_, s_, 1)])
    config = mod.get_config()
    config.grpo.gather_zero3 = False  # each layer's params gathered at every decode step: slower than ZeRO-1's
    for c in planner.plan(config, cluster, space, compile_top=0).ranked:
        lay = c.layout
        if lay.zero_stage == 3 and lay.data > 1 and (lay.data, lay.tensor, lay.stage, 1) in price:
            assert c.time["round"]["decode_s"] > price[(lay.data, lay.tensor, lay.stage, 1)]
            assert c.generation["params_bytes"] * lay.data == pytest.approx(held[(lay.data, lay.tensor, lay.stage)])
    config = mod.get_config()
    config.grpo.kv_cache_gib = 2.0
    for c in planner.plan(config, hardware.cluster("h100", 8), space, compile_top=0).ranked:
        assert 2 * 2 ** 30 - block_bytes // c.layout.tensor < c.generation["kv_bytes"] <= 2 * 2 ** 30
    config.grpo.kv_cache_gib = 100.0
    big = planner.plan(config, hardware.cluster("h100", 8), space, compile_top=0)
    assert all(c.fits(big.capacity) is False for c in big.ranked)
    assert table.why(big, big.ranked[0], big.ranked[0]).startswith("its round's generation does not fit (KV pool 100.0")


def test_a_rounds_price_is_built_from_the_engines_compiled_flops_and_pool(monkeypatch):
    """A tiny Llama's GRPO round (4 prompts of 32 tokens x 4 completions of 32, one device): the planner's prefill
    FLOPs equal the HLO-counted matmul FLOPs of the engine's compiled prefill of those prompts, its FLOPs per decode
    step those of the compiled decode loop's step (temperature 1: the whole head; the attention, products and sums
    there, priced as 4·L·a·d_h·S), and its KV pool the engine's."""
    from jaxpar.analysis.hlo_flops import hlo_flops
    from jaxpar.generate import cache as kv, decode
    from jaxpar.generate.engine import Engine, Request
    from jaxpar.plan import rollout

    config = tiny_config(**{"train.objective": "grpo", "model.arch": "llama", "model.kv_heads": 2, "model.layers": 2,
                            "model.embed": 64, "model.heads": 4, "model.mlp": 128, "model.seq_len": 64,
                            "grpo.max_completion_length": 32, "grpo.num_generations": 4,
                            "train.global_batch_size": 4})
    model, rnd = cost.Model.from_config(config, 256), rollout.Round.from_config(config)
    assert (rnd.prompts, rnd.generations, rnd.prompt, rnd.completion) == (4, 4, 32, 32)
    cfg = gpt.config_from(config, 256, 1)
    seen = {}
    for name in ("_jit_prefill", "_jit_decode"):
        def wrap(*a, f=getattr(decode, name), name=name):
            seen.setdefault(name, (f.lower(*a).compile().as_text(), a))
            return f(*a)
        monkeypatch.setattr(decode, name, wrap)
    engine = Engine(gpt.Forward(cfg), gpt.init_params(cfg, jax.random.key(0)), slots=16, kv_block=16, chunk=32)
    prompts = [[(7 * i + j) % 255 + 1 for j in range(32)] for i in range(4)]
    engine.generate([Request(p, max_new_tokens=32, temperature=1.0, seed=i, stream=g)
                     for i, p in enumerate(prompts) for g in range(4)])
    text, args = seen["_jit_prefill"]
    assert args[2].shape[1] == 32 and args[2].shape[0] >= 4  # (the group's prompts, one prefill each, rows padded)
    assert hlo_flops(text)["total"] == rollout.prefill_flops(model, rnd, args[2].shape[0])
    text, args = seen["_jit_decode"]
    want = rollout.decode_flops(model, rnd, 16, model.padded_vocab(1), attention=False)  # (attention: no dot)
    assert args[6] == "plain" and hlo_flops(text)["total"] == want
    assert rollout.decode_flops(model, rnd, 16, 256) - want == 16 * 4 * 2 * 64 * 64  # 4·L·a·d_h·S a row
    gen = memory.Generation(config)(Layout(1, 1, 1, 1), model)
    assert gen["kv_bytes"] == engine.stats["kv_blocks"] * kv.block_bytes(cfg, 16) == 16 * 4 * 16 * gen["position_bytes"]


def test_a_round_whose_rows_outgrow_a_devices_pool_prices_their_kv_split_over_context():
    """(context 2), rows of 64 positions (4 blocks of 16): with a pool of 2 whole blocks a device, a row split
    over data x context would find 2 blocks in its part, so the engine splits each row's positions over context
    (`cache.kv_over_context`) and the planner prices that: half of each position's keys and values on a device, the
    attention over half the positions, and the attention's maxima, sums and outputs summed over context; with the
    default pool (every slot's whole context) the rows split over context, each row's cache whole on one device."""
    from jaxpar.generate import cache as kv
    from jaxpar.plan import rollout

    config = tiny_config(**{"train.objective": "grpo", "model.arch": "llama", "model.kv_heads": 2, "model.layers": 2,
                            "model.embed": 64, "model.heads": 4, "model.mlp": 128, "model.seq_len": 64,
                            "grpo.max_completion_length": 32, "grpo.num_generations": 4, "mesh.data": 1,
                            "mesh.context": 2, "train.global_batch_size": 4})
    model, rnd, lay = cost.Model.from_config(config, 256), rollout.Round.from_config(config), Layout(1, 1, 1, 1)
    lay = dataclasses.replace(lay, context=2)
    whole = kv.block_bytes(gpt.config_from(config, 256, 1), 16) / 16  # one position's keys and values, every layer
    rows = memory.Generation(config)(lay, model)
    assert rows["kv_context"] is False and rows["position_bytes"] == whole
    config.grpo.kv_cache_gib = 2 * 16 * whole / 2 ** 30
    split = memory.Generation(config)(lay, model)
    assert split["kv_context"] is True and split["position_bytes"] == whole / 2 and split["kv_blocks"] == 4
    attention = 4 * 2 * 64 * 64  # 4·L·a·d_h·S a row
    assert rollout.decode_flops(model, rnd, 16, 256, context=2) == rollout.decode_flops(
        model, rnd, 16, 256, attention=False) + 16 * attention / 2
    cl = hardware.cluster("h100", 2)
    one = rollout.round_time(model, rnd, lay, cl, split | {"params_bytes": 0.0}, 0.0)
    alone = rollout.round_time(model, rnd, dataclasses.replace(lay, context=1), cl, split | {"params_bytes": 0.0,
                                                                                            "kv_context": False}, 0.0)
    assert one["decode_s"] > alone["decode_s"]  # the same reads and FLOPs / 2 of attention, plus the all-reduces
