"""Qwen3-30B-A3B (Qwen team 2025: 48 layers, d_model 2048, 32 heads of size 128 with 4 KV heads and RMSNorm on q and
k, 128 SwiGLU experts of width 768 per layer, top-8 with renormalised weights, vocab 151936, RoPE θ 1e6, untied;
30.5B parameters, 3.3B active) for one 8-GPU server (H100/H200 80+ GB).

Layout: expert 8 (16 experts of every layer per device, all-to-all within the server), the batch split over the 8
expert devices, ZeRO-2 over them for the attention and embedding weights' optimizer state and gradients, bfloat16
weights and Adam moments, full recompute, capacity factor 1.25 per sequence (dropless, the published model's routing,
is `--config.model.capacity_factor=0`: its buffers hold seq_len slots for each of the 128 experts). Aux-loss weight
0.001 (Qwen3's `router_aux_loss_coef`). 8 sequences of 4096 tokens per step, one per device and no accumulation
(gradient accumulation adds a float32 gradient-sized buffer: 14 GiB per device here). `--dry_run` on 8 fake CPU
devices: 61.9 GiB per device (docs/moe.md). To fine-tune Qwen's weights:
`--config.init_from=hf:/path/to/Qwen3-30B-A3B`.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "qwen3_30b_a3b"
    c.mesh.update(data=1, tensor=1, stage=1, expert=8)
    c.model.update(arch="llama", vocab_size=151936, seq_len=4096, max_positions=40960, layers=48, embed=2048,
                   heads=32, kv_heads=4, head_dim=128, qk_norm=True, mlp=6144, norm_eps=1e-6, rope_theta=1e6,
                   tie_embeddings=False, remat="full", experts=128, experts_per_token=8, expert_mlp=768,
                   router="softmax", router_norm_topk=True, capacity_factor=1.25, aux_loss=0.001)
    c.train.update(steps=100_000, global_batch_size=8, microbatches=1, seed=0,
                   param_dtype="bfloat16", compute_dtype="bfloat16")
    c.optim.update(lr=1e-4, min_lr_ratio=0.1, warmup_steps=2000, decay_steps=100_000, weight_decay=0.1,
                   b1=0.9, b2=0.95, clip_norm=1.0, zero_stage=2)
    c.data.update(sources="shakespeare", tokenizer="byte", val_fraction=0.01)
    c.checkpoint.update(every_steps=500, keep=3)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=500, batches=10)
    return c
