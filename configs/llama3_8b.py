"""Llama 3 8B (32 layers, d_model 4096, 32 heads, 8 KV heads, SwiGLU 14336, vocab 128256, RoPE θ 500000, untied, 8192
tokens) for one 8-GPU server (H100/H200 80+ GB): tensor 8 over NVLink, each device one KV head.

Why tensor 8 and not ZeRO-3 over data 8: on the XLA attention path (CPU, or `model.attention=xla`), attention
materialises its `[heads, seq, seq]` float32 scores: 32 heads x 8192² x 4 B = 8.6 GB per sequence and layer on a
device that holds all heads, 1.1 GB with 4 heads per device (on GPU `model.attention=auto` picks a fused kernel). Full
recompute keeps one layer's activations at a time. `--dry_run` shows the per-device bytes (docs/layouts.md). To
continue pre-training or fine-tune Meta's weights, add `--config.init_from=hf:/path/to/Meta-Llama-3-8B` (the shape and
tokenizer then come from that directory).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "llama3_8b"
    c.mesh.update(data=1, tensor=8, stage=1)
    c.model.update(arch="llama", vocab_size=128256, seq_len=8192, max_positions=8192, layers=32, embed=4096,
                   heads=32, kv_heads=8, mlp=14336, norm_eps=1e-5, rope_theta=500000.0, rope_scaling="none",
                   tie_embeddings=False, remat="full")
    c.train.update(steps=100_000, global_batch_size=64, microbatches=64, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.optim.update(lr=3e-4, min_lr_ratio=0.1, warmup_steps=2000, decay_steps=100_000, weight_decay=0.1,
                   b1=0.9, b2=0.95, clip_norm=1.0)
    c.data.update(sources="shakespeare", tokenizer="byte", val_fraction=0.01)
    c.checkpoint.update(every_steps=500, keep=3)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=500, batches=10)
    return c
