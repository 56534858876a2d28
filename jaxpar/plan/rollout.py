"""The price of a GRPO round's sampling on a layout: what an objective that samples on the training mesh adds to
the train step `cost.step_time` prices (the planner ranks layouts by their sum).

A round samples G completions of each of B prompts (`train.global_batch_size`, `grpo.num_generations`) with the
engine on the decode layout (the training layout, the layers gathered over `stage`; rows over data x expert x
context, matmuls over tensor; rows longer than a device's part of the pool: each row's KV positions over context
instead, `cache.kv_over_context`). Prompts are priced at the room the config leaves them, P = model.seq_len -
grpo.max_completion_length, and every completion at its longest, R = grpo.max_completion_length (an upper bound:
the round ends at its longest row). With N a token's active matmul weights in the blocks, d the width, a·d_h the
attention width, V the padded vocabulary, S the engine's cache length (P + R rounded up to 64), per device:
  prefill  one per prompt (the engine's shared prefill): 2·N·P + 4·L·a·d_h·P² matmul FLOPs a prompt (XLA's
           attention over the prompt's positions, the whole square, masked; in chunks, each over the prompt so
           far), at `cost.MATMUL_EFFICIENCY` of the peak;
  decode   R steps of B·G rows: 2·N + 2·V·d + 4·L·a·d_h·S FLOPs a row a step (the head's whole vocabulary; the
           attention over the row's gathered blocks, 1 / context of them on a device when the KV is split), and the
           bytes the step reads, the weights a device holds in the decode layout and its rows' KV (the mean over
           the round, P + R/2 positions), at the HBM bandwidth: the step takes the longer of the two, plus 2 tensor
           all-reduces of [rows, d] per layer (a split KV: also the attention's float32 maxima, sums and outputs
           summed over context); under ZeRO-3 the params are gathered whole over ZeRO's group (data x expert x
           context) once a round (priced with the prefill), or with `grpo.gather_zero3` off each layer's params are
           all-gathered at every step;
  passes   the old policy's forward (grpo.num_iterations > 1 or an importance-sampling correction) and the
           reference's (grpo.beta > 0) over the step's rows: a third of the train step's matmul work each.
"""
from __future__ import annotations

import dataclasses

from jaxpar.generate.engine import cache_length
from jaxpar.plan.cost import MATMUL_EFFICIENCY, Model, collective_time
from jaxpar.plan.hardware import Cluster
from jaxpar.plan.space import Layout
from jaxpar.train import objectives


@dataclasses.dataclass(frozen=True)
class Round:
    """The shape of a round, from a config whose objective samples (`from_config`: None for one that does not)."""
    prompts: int  # B
    generations: int  # G
    prompt: int  # P tokens a prompt
    completion: int  # R tokens a completion
    passes: int  # forward passes over the step's rows besides the train step's (old policy, reference)

    @classmethod
    def from_config(cls, config) -> Round | None:
        obj = objectives.from_config(config)
        if not obj.samples:
            return None
        R = obj.max_completion_length
        return cls(int(config.train.global_batch_size), obj.num_generations, int(config.model.seq_len) - R, R,
                   int(obj.old_policy_pass) + int(obj.beta > 0))

    def cache_length(self, model: Model) -> int:
        """The engine's cache length S (`engine.cache_length`)."""
        return cache_length(self.prompt + self.completion, model.max_positions or model.seq)


def _attention_width(model: Model) -> int:
    return model.heads * (model.head_dim or model.embed // model.heads)


def prefill_flops(model: Model, rnd: Round, prompts: int) -> float:
    """Matmul FLOPs of the prefill of `prompts` prompts (one device's, tensor 1)."""
    per = 2 * model.layers * model.layer_matmul * rnd.prompt
    per += 4 * model.layers * _attention_width(model) * rnd.prompt * rnd.prompt
    return prompts * per


def decode_flops(model: Model, rnd: Round, rows: int, vocab: int, attention: bool = True, context: int = 1) -> float:
    """Matmul FLOPs of one decode step of `rows` rows (tensor 1): the blocks, the head over `vocab` (padded), and
    (`attention`) the attention over the cache length, which the engine runs as fused products and sums on a CPU
    and as the paged kernel on a GPU (no matmul in XLA's count either way), over the positions a device holds of
    each row (1 / `context` of them)."""
    per = 2 * model.layers * model.layer_matmul + 2 * vocab * model.embed
    scores = 4 * model.layers * _attention_width(model) * rnd.cache_length(model) / context
    return rows * (per + (scores if attention else 0))


def round_time(model: Model, rnd: Round, lay: Layout, cl: Cluster, gen: dict, train_compute_s: float) -> dict:
    """Seconds of one round on a device: {"prefill_s", "decode_s", "passes_s", "round_s", "decode_bound":
    "compute" | "memory"}. `gen`: `memory.Generation`'s entry ("params_bytes": the weights a device holds in the
    decode layout, ZeRO-3's shard unless "zero3_gathered"; "position_bytes": one position's keys and values, every
    layer, on a device; "kv_context": each row's KV split over context, else the rows, `cache.kv_over_context`);
    `train_compute_s`: the train step's compute (`cost.step_time`'s "compute_s"), whose forward third a pass
    costs."""
    c = lay.context if gen.get("kv_context") else 1  # the split of a row's positions
    t, split = lay.tensor, lay.data * lay.expert * lay.context // c  # the rows' split
    rate = cl.device.peak_flops * MATMUL_EFFICIENCY
    prompts, rows = -(-rnd.prompts // split), -(-rnd.prompts * rnd.generations // split)
    tp_bw = cl.group_bw(t, 1)
    prefill = prefill_flops(model, rnd, prompts) / t / rate
    prefill += 2 * model.layers * collective_time("all-reduce", prompts * rnd.prompt * model.embed
                                                  * model.compute_bytes, t, tp_bw)
    flops = decode_flops(model, rnd, rows, model.padded_vocab(t), context=c) / t / rate
    zero = lay.data * lay.expert * lay.context if lay.zero_stage == 3 else 1  # ZeRO-3's group
    sharded = zero > 1 and not gen.get("zero3_gathered")  # each layer gathered at every step, then read
    weights = gen["params_bytes"] * (zero if sharded else 1)
    read = weights + rows * (rnd.prompt + rnd.completion / 2) * gen["position_bytes"]
    memory = read / cl.device.hbm_bw
    step = max(flops, memory) + 2 * model.layers * collective_time("all-reduce", rows * model.embed
                                                                   * model.compute_bytes, t, tp_bw)
    if c > 1:  # each layer's attention: its float32 maxima, sums and outputs (a / t heads of a row) over context
        per_head = _attention_width(model) / model.heads + 2
        step += model.layers * collective_time("all-reduce", rows * model.heads / t * per_head * 4, c,
                                               cl.group_bw(c, t))
    if sharded:
        step += model.layers * collective_time("all-gather", weights / model.layers, zero, cl.group_bw(zero, t))
    decode = rnd.completion * step
    if zero > 1 and not sharded:  # the params gathered whole once for the round
        prefill += collective_time("all-gather", weights, zero, cl.group_bw(zero, t))
    passes = rnd.passes * train_compute_s / 3
    return {"prefill_s": prefill, "decode_s": decode, "passes_s": passes, "round_s": prefill + decode + passes,
            "decode_bound": "compute" if flops >= memory else "memory"}
