"""Mixtral 8x7B (Jiang et al. 2024: 32 layers, d_model 4096, 32 heads, 8 KV heads, 8 SwiGLU experts of width 14336
per layer, top-2 with renormalised weights, vocab 32000, RoPE θ 1e6, untied; 46.7B parameters, 12.9B active) for one
8-GPU server of 80 GB GPUs (A100, H100) with host offload: `--dry_run` on 8 fake CPU devices says 68.7 GiB (73.7 GB)
per device and 21.7 GiB of pinned host memory per device (174 GiB per server) for AdamW's moments, which
`optim.offload=optimizer` keeps on the host between steps (docs/offload.md). Without offload the step needs
90.4 GiB per device: an H200 server (141 GB), with `--config.optim.offload=none`, skips the host link's time.

Layout: expert 8 (one expert of every layer per device, the tokens sent to it by all-to-all), the batch split over
the 8 expert devices, ZeRO-2 over them for the attention and embedding weights' optimizer state and gradients,
bfloat16 weights and Adam moments, full recompute, capacity factor 1.25 per sequence (dropless, the published
model's routing, is `--config.model.capacity_factor=0`: its buffers hold seq_len slots per expert). Aux-loss weight
0.02 (Mixtral's `router_aux_loss_coef`). 8 sequences of 4096 tokens per step, one per device, no accumulation. To
fine-tune Mistral's weights: `--config.init_from=hf:/path/to/Mixtral-8x7B-v0.1`.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "mixtral_8x7b"
    c.mesh.update(data=1, tensor=1, stage=1, expert=8)
    c.model.update(arch="llama", vocab_size=32000, seq_len=4096, max_positions=32768, layers=32, embed=4096,
                   heads=32, kv_heads=8, mlp=14336, norm_eps=1e-5, rope_theta=1e6, tie_embeddings=False,
                   remat="full", experts=8, experts_per_token=2, expert_mlp=14336, router="softmax",
                   router_norm_topk=True, capacity_factor=1.25, aux_loss=0.02)
    c.train.update(steps=100_000, global_batch_size=8, microbatches=1, seed=0,
                   param_dtype="bfloat16", compute_dtype="bfloat16")
    c.optim.update(lr=1e-4, min_lr_ratio=0.1, warmup_steps=2000, decay_steps=100_000, weight_decay=0.1,
                   b1=0.9, b2=0.95, clip_norm=1.0, zero_stage=2, offload="optimizer")
    c.data.update(sources="shakespeare", tokenizer="byte", val_fraction=0.01)
    c.checkpoint.update(every_steps=500, keep=3)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=500, batches=10)
    return c
