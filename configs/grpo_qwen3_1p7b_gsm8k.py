"""GRPO of Qwen3-1.7B on GSM8K, on one 8-GPU server (H100/H200 80+ GB), with a math-verify exact-answer reward
(docs/rl.md#qwen3-17b-on-gsm8k).

Qwen3-1.7B's shape (28 layers, d_model 2048, 16 heads of size 128 with 8 KV heads and RMSNorm on q and k, SwiGLU
width 6144, vocab 151936, RoPE θ 1e6, tied embeddings). GSM8K's `main` training split through `hfds:` (its card
lists two configs: `data.hf_data_files` names `main`'s file), each record turned into a system prompt asking for
the number inside <answer></answer> and the question (`grpo.map_records=jaxpar.data.prompts:gsm8k`), the number
after `####` the solution. Per step 32 prompts x 8 completions (256 rows) of at most 1024 tokens, sampled at
temperature 1 by the generation engine on the training mesh; TRL's defaults otherwise (loss `dapo`, epsilon 0.2 with
DAPO's clip-higher 0.28, advantages scaled per group, one pass per round, lr 1e-6), the k3 KL to the starting model at
beta 0.04 (its frozen copy in the state, sharded as the policy).

Variants (`--config configs/grpo_qwen3_1p7b_gsm8k.py:VARIANT`):
- `full` (default): every weight trains; ZeRO 3 over data 8, float32 weights and AdamW moments, bf16 compute, full
  recompute, 8 microbatches of 32 rows;
- `lora`: rank-32 adapters on every projection (alpha 64), the frozen base in bf16 (the reference is the base with
  the adapters off: no second copy), lr 1e-5, data 8 without ZeRO (the base is small), 4 microbatches.

The shape is Qwen3-1.7B's, so `--dry_run` needs no checkpoint; to train, point it at the checkpoint:
    --config.init_from=hf:Qwen/Qwen3-1.7B   (or hf:/path/to/Qwen3-1.7B)
"""
from jaxpar.config import base_config


def get_config(variant: str = "full"):
    if variant not in ("full", "lora"):
        raise ValueError(f"configs/grpo_qwen3_1p7b_gsm8k.py:{variant}: the variants are full and lora.")
    c = base_config()
    c.name = f"grpo_qwen3_1p7b_gsm8k_{variant}"
    c.mesh.update(data=8, tensor=1, stage=1)
    c.model.update(arch="llama", vocab_size=151936, seq_len=1536, max_positions=40960, layers=28, embed=2048,
                   heads=16, kv_heads=8, head_dim=128, qk_norm=True, mlp=6144, norm_eps=1e-6, rope_theta=1e6,
                   tie_embeddings=True, remat="full")
    c.train.update(objective="grpo", steps=500, global_batch_size=32, microbatches=8, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.grpo.update(num_generations=8, max_completion_length=1024, temperature=1.0, loss_type="dapo", epsilon=0.2,
                  epsilon_high=0.28, beta=0.04, scale_rewards="group", num_iterations=1,
                  rewards="jaxpar.rl.rewards:exact_answer", map_records="jaxpar.data.prompts:gsm8k")
    c.optim.update(zero_stage=3, lr=1e-6, min_lr_ratio=1.0, warmup_steps=0, decay_steps=500, weight_decay=0.0,
                   b1=0.9, b2=0.99, clip_norm=1.0)
    c.data.update(sources="hfds:openai/gsm8k", hf_data_files="main/train-*.parquet", val_fraction=0.02)
    c.checkpoint.update(every_steps=50, keep=2)
    c.log.update(every_steps=1)
    c.eval.update(every_steps=50, batches=4)
    if variant == "lora":
        c.lora.update(rank=32, alpha=64.0, targets="all-linear", base_dtype="bfloat16")
        c.train.update(microbatches=4)
        c.optim.update(zero_stage=1, lr=1e-5)
    return c
