"""What a training objective is, as one object (`Objective`): the step, the trainer, the data opening and `validate`
ask it instead of testing `train.objective`.

An objective answers: its name (`train.objective`) and the config section of its settings (`section`, e.g. `dpo`);
the data it reads (`data_kinds`: documents, conversations, pairs, images; `prompts` for RL); its head
`head(fwd, params, x, mb) -> (loss_sum, count)`, run where the loss runs in every gradient engine (the last pipeline
stage, or after the layer scan) on one microbatch `mb` (x, y, w, seg, ids, and `ref` with a reference: see
`jaxpar/train/step.py`), `count` an array of sums the step adds over microbatches and data shards; `total(mask,
seg)`, what the step's loss sum is divided by (the same on every layout and accumulation); `metrics(count, total)`
and their names (`metric_names`); its reference model, always the model the run starts from (`reference`: "" none,
"copy" a frozen copy of the starting weights in the state, "adapters_off" the policy with its fresh LoRA adapters
off, "adapters" the frozen base with a frozen copy of the starting `lora.adapter`, "batch" precomputed sums that
arrive with each batch); whether dropout runs in its passes (`dropout`); the packing its data needs (`packing`: what
`data.packing=auto` becomes); and its own rules (`errors`).
"""
from __future__ import annotations


class Objective:
    name = ""  # `train.objective`
    section = ""  # the config section of its settings ("": none)
    data_kinds: tuple = ()  # what its data is: documents | conversations | pairs | images | prompts
    metric_names: tuple = ()  # the names `metrics` logs (besides the loss)
    reference = ""  # its reference model: "" | copy | adapters_off | adapters | batch
    packing = ""  # the `data.packing` its data needs whatever the records ("": `auto` judges the records)
    dropout = True  # whether the model's dropout runs in its training passes (DPO: `dpo.dropout`)
    samples = False  # its rounds are sampled by the generation engine on the training mesh (its section: kv_block)
    shares_prefixes = False  # its rows' segment ids name shared prefixes (`kernels/segments.py`: GRPO's shared rows)

    @classmethod
    def from_config(cls, config) -> "Objective":
        """The objective with its settings (`config[section]`)."""
        return cls()

    def reference_head(self, rows: int):
        """The pass that reads the reference's inputs of a batch of `rows` rows (`ref`), when its reference is weights
        ("copy", "adapters_off", "adapters"): an object with `head`, like an objective's."""
        raise NotImplementedError

    def rows(self, config) -> int:
        """The rows of a step's global batch (what microbatches and data shards split): `train.global_batch_size`."""
        return int(config.train.global_batch_size)

    def batch_shapes(self, config, default: dict, layout=None) -> dict:
        """{name: (shape, dtype)} of a global batch of its steps; `default` the data's (`data.batch_shapes`)."""
        return default

    @staticmethod
    def starting_model(config) -> str:
        """The reference kind that is the model the run starts from, as weights: under LoRA the frozen base with the
        starting `lora.adapter`'s adapters ("adapters") or, with fresh adapters, the base alone ("adapters_off"); else
        a frozen copy of the starting weights ("copy")."""
        if int(config.lora.rank) > 0:
            return "adapters" if config.lora.adapter else "adapters_off"
        return "copy"

    @staticmethod
    def errors(config, lay) -> list[str]:
        """Its own rules on a run config that names it, one line each (`jaxpar/validate.py` adds them)."""
        return []

    def head(self, fwd, params, x, mb):
        raise NotImplementedError

    def total(self, mask, seg, batch):
        return mask.sum()

    def metrics(self, count, total) -> dict:
        return {}
