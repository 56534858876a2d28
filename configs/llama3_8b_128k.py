"""Llama 3 8B at 131,072 tokens (Llama 3.1's long context: RoPE θ 500000 with Llama 3's frequency scaling, factor 8
over the original 8192) for one 8-GPU server (H100/H200 80+ GB): context parallelism over all 8 devices.

Layout: `mesh.context=8`: each device holds 16,384 tokens of every sequence (two chunks of 8,192, chunk i and 15 − i,
so the causal attention work is equal on every device, docs/context.md); attention gathers the other devices' K/V
(8 KV heads of 128: 256 MiB per layer and sequence in bf16) and runs blockwise, never holding a [16K, 128K] score
matrix. The parameters are replicated over `context` as over `data`, so ZeRO 3 shards the float32 weights, gradients
and AdamW moments over the 8 devices (16 GB per device for all of them). Full recompute keeps one layer's
activations at a time. 8 sequences (1M tokens) per step, one per microbatch. `--dry_run` on 8 fake CPU devices
gives the per-device bytes (docs/results/context.md).

On 32 GPUs (4 servers): `--config.mesh.data=4`, keeping context 8 within a server: the batch splits over data, ZeRO 3
over data x context. To extend Meta's 8K model to 128K, add `--config.init_from=hf:/path/to/Meta-Llama-3-8B`.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "llama3_8b_128k"
    c.mesh.update(data=1, tensor=1, stage=1, context=8)
    c.model.update(arch="llama", vocab_size=128256, seq_len=131072, max_positions=131072, layers=32, embed=4096,
                   heads=32, kv_heads=8, mlp=14336, norm_eps=1e-5, rope_theta=500000.0, rope_scaling="llama3",
                   rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192,
                   tie_embeddings=False, remat="full")
    c.train.update(steps=10_000, global_batch_size=8, microbatches=8, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.optim.update(lr=1e-5, min_lr_ratio=0.1, warmup_steps=100, decay_steps=10_000, weight_decay=0.1,
                   b1=0.9, b2=0.95, clip_norm=1.0, zero_stage=3)
    c.data.update(sources="shakespeare", tokenizer="byte", val_fraction=0.01)
    c.checkpoint.update(every_steps=200, keep=3)
    c.log.update(every_steps=1)
    c.eval.update(every_steps=200, batches=2)
    return c
