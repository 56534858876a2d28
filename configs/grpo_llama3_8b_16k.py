"""GRPO of Llama 3.1 8B with completions of up to 16,384 tokens (long reasoning) on one 8-GPU server (H100/H200
80+ GB), with a math-verify exact-answer reward on GSM8K's prompts (docs/planning.md#a-grpo-rounds-price).

Llama 3.1 8B's shape (configs/llama3_8b_128k.py: RoPE θ 500000 with Llama 3's frequency scaling). A training row is
a prompt of up to 1,024 tokens and a completion of up to 16,384: 17,408 positions, and a shared-prompt row (a prompt
and its 8 completions) up to 132,096. Layout (docs/planning.md#a-grpo-rounds-price): tensor 4 with sequence
parallelism x context 2 (each row's tokens over 2 devices in the balanced order, attention gathering the other's K/V
blockwise, docs/context.md), ZeRO 3 over context (the params are replicated over `context` as over `data`), float32
weights and AdamW moments, bf16 compute, full recompute, 4 microbatches. The planner ranks tensor 8 first, but its
shared rows of 132K positions need context parallelism's blockwise attention to fit. The engine decodes on the same
mesh: the params gathered whole over context once a round (grpo.gather_zero3), the rows split over context, KV heads
and matmuls over tensor. Per step 8 prompts x 8 completions; TRL's defaults otherwise (loss `dapo`, clip-higher 0.28,
one pass per round, no KL term), lr 1e-6.

The shape is Llama 3.1 8B's, so `--dry_run` and the planner need no checkpoint; to train, point it at the weights:
    --config.init_from=hf:meta-llama/Llama-3.1-8B-Instruct   (or hf:/path/to/it)
"""
from jaxpar.config import config_beside


def get_config():
    c = config_beside(__file__, "llama3_8b_128k.py")  # the model's shape
    c.name = "grpo_llama3_8b_16k"
    c.mesh.update(data=1, tensor=4, stage=1, context=2)
    c.model.update(seq_len=17408, sequence_parallel=True)
    c.train.update(objective="grpo", steps=200, global_batch_size=8, microbatches=4, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.grpo.update(num_generations=8, max_completion_length=16384, temperature=1.0, loss_type="dapo", epsilon=0.2,
                  epsilon_high=0.28, beta=0.0, scale_rewards="group", num_iterations=1,
                  rewards="jaxpar.rl.rewards:exact_answer", map_records="jaxpar.data.prompts:gsm8k")
    c.optim.update(zero_stage=3, lr=1e-6, min_lr_ratio=1.0, warmup_steps=0, decay_steps=200, weight_decay=0.0,
                   b1=0.9, b2=0.99, clip_norm=1.0)
    c.data.update(sources="hfds:openai/gsm8k", hf_data_files="main/train-*.parquet", val_fraction=0.02)
    c.checkpoint.update(every_steps=25, keep=2)
    c.log.update(every_steps=1)
    c.eval.update(every_steps=50, batches=1)
    return c
