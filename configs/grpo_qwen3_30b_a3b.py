"""GRPO of Qwen3-30B-A3B on GSM8K on two 8-GPU servers (16 H100/H200 80+ GB), with a math-verify exact-answer
reward (docs/planning.md#a-grpo-rounds-price).

Qwen3-30B-A3B's shape (configs/qwen3_30b_a3b.py: 48 layers, 128 experts of width 768, top-8) with the published
routing, dropless (`model.capacity_factor=0`), so routing replay makes every training pass route each token to the
experts that sampled it. Layout: expert 8 within each server (the all-to-all on NVLink), data 2 across the servers,
bf16 weights and AdamW moments with ZeRO 1 over the 16 devices, full recompute. Per step 64 prompts x 8 completions
(512 rows) of at most 2,048 tokens, prompts of up to 512; TRL's defaults otherwise (loss `dapo`, epsilon 0.2 with
clip-higher 0.28, advantages per group, one pass per round, no KL term: no reference copy), lr 1e-6.

The shape is Qwen3-30B-A3B's, so the planner and `--dry_run` need no checkpoint; to train, point it at the weights:
    --config.init_from=hf:Qwen/Qwen3-30B-A3B   (or hf:/path/to/Qwen3-30B-A3B)
and launch it with `scripts/slurm/train.sbatch` on 2 nodes (docs/multihost.md).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "grpo_qwen3_30b_a3b"
    c.mesh.update(data=2, tensor=1, stage=1, expert=8)
    c.model.update(arch="llama", vocab_size=151936, seq_len=2560, max_positions=40960, layers=48, embed=2048,
                   heads=32, kv_heads=4, head_dim=128, qk_norm=True, mlp=6144, norm_eps=1e-6, rope_theta=1e6,
                   tie_embeddings=False, remat="full", experts=128, experts_per_token=8, expert_mlp=768,
                   router="softmax", router_norm_topk=True, capacity_factor=1.25, aux_loss=0.001)
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
