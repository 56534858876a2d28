"""Supervised fine-tuning of Llama 3 8B (Instruct or base) on conversations, on one 8-GPU server (H100/H200 80+ GB):
the weights sharded over all 8 devices (ZeRO 3 over data 8, FSDP's layout), bf16 compute with float32 weights and
AdamW moments, full recompute, 4096-token rows of whole conversations packed best-fit decreasing, the loss on the
assistant turns (docs/finetune.md).

The shape is Llama 3 8B's, so `--dry_run` needs no checkpoint; to train, point it at the checkpoint and the data:
    --config.init_from=hf:/path/to/Llama-3.1-8B-Instruct --config.data.sources=/path/to/chat.jsonl
(the shape, tokenizer and chat template then come from that directory).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "sft_llama3_8b"
    c.mesh.update(data=8, tensor=1, stage=1)
    c.model.update(arch="llama", vocab_size=128256, seq_len=4096, max_positions=131072, layers=32, embed=4096,
                   heads=32, kv_heads=8, mlp=14336, norm_eps=1e-5, rope_theta=500000.0, rope_scaling="llama3",
                   tie_embeddings=False, remat="full")
    c.train.update(steps=2000, global_batch_size=64, microbatches=8, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.optim.update(zero_stage=3, lr=1e-5, min_lr_ratio=0.1, warmup_steps=50, decay_steps=2000, weight_decay=0.0,
                   b1=0.9, b2=0.95, clip_norm=1.0)
    c.data.update(sources="chat.jsonl", packing="bfd", truncate="right", loss_on="auto", val_fraction=0.02)
    c.checkpoint.update(every_steps=250, keep=2)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=250, batches=8)
    return c
