"""GRPO of Qwen3-30B-A3B on GSM8K on two 8-GPU servers (16 H100/H200 80+ GB), with a math-verify exact-answer
reward (docs/planning.md#a-grpo-rounds-price).

Qwen3-30B-A3B's shape and routing (configs/qwen3_30b_a3b.py: 48 layers, 128 experts of width 768, top-8, capacity
factor 1.25: routing replay replays the sampled experts, not which choices overflow; `model.capacity_factor=0`, the
published dropless routing, replays exactly but its buffers hold every position for every expert). Layout (the
planner's, docs/planning.md): expert 8 within each server (the all-to-all on NVLink), data 2 across the servers,
bf16 weights and AdamW moments with ZeRO 2, full recompute, 16 microbatches (what the dry run needs to fit 80 GB).
Per step 64 prompts x 8 completions (512 rows) of at most 2,048 tokens, prompts of up to 512; TRL's defaults
otherwise (loss `dapo`, epsilon 0.2 with clip-higher 0.28, advantages per group, one pass per round, no KL term: no
reference copy), lr 1e-6.

The shape is Qwen3-30B-A3B's, so the planner and `--dry_run` need no checkpoint; to train, point it at the weights:
    --config.init_from=hf:Qwen/Qwen3-30B-A3B   (or hf:/path/to/Qwen3-30B-A3B)
and launch it with `scripts/slurm/train.sbatch` on 2 nodes (docs/multihost.md).
"""
from jaxpar.config import config_beside


def get_config():
    c = config_beside(__file__, "qwen3_30b_a3b.py")  # the model's shape
    c.name = "grpo_qwen3_30b_a3b"
    c.mesh.update(data=2, tensor=1, stage=1, expert=8)
    c.model.update(seq_len=2560)
    c.train.update(objective="grpo", steps=300, global_batch_size=64, microbatches=16, seed=0,
                   param_dtype="bfloat16", compute_dtype="bfloat16")
    c.grpo.update(num_generations=8, max_completion_length=2048, temperature=1.0, loss_type="dapo", epsilon=0.2,
                  epsilon_high=0.28, beta=0.0, scale_rewards="group", num_iterations=1,
                  rewards="jaxpar.rl.rewards:exact_answer", map_records="jaxpar.data.prompts:gsm8k")
    c.optim.update(zero_stage=2, lr=1e-6, min_lr_ratio=1.0, warmup_steps=0, decay_steps=300, weight_decay=0.0,
                   b1=0.9, b2=0.99, clip_norm=1.0)
    c.data.update(sources="hfds:openai/gsm8k", hf_data_files="main/train-*.parquet", val_fraction=0.02)
    c.checkpoint.update(every_steps=50, keep=2)
    c.log.update(every_steps=1)
    c.eval.update(every_steps=50, batches=2)
    return c
