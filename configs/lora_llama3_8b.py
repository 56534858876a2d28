"""LoRA fine-tuning of Llama 3 8B (Instruct or base) on conversations on one 80 GB GPU: rank-16 adapters on every
projection of the blocks (PEFT's `all-linear`, alpha 32, dropout 0.05), the frozen base held in bf16 (no gradient, no
AdamW state), the adapters and their moments in float32, bf16 compute, full recompute, 4096-token rows of whole
conversations packed best-fit decreasing, the loss on the assistant turns, 16 rows per step one at a time
(docs/finetune.md#lora).

The shape is Llama 3 8B's, so `--dry_run` needs no checkpoint; to train, point it at the checkpoint and the data:
    --config.init_from=hf:/path/to/Llama-3.1-8B-Instruct --config.data.sources=/path/to/chat.jsonl
Export the adapters with `python -m jaxpar.export --format peft` (or the merged model with `--format hf`).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "lora_llama3_8b"
    c.mesh.update(data=1, tensor=1, stage=1)
    c.model.update(arch="llama", vocab_size=128256, seq_len=4096, max_positions=131072, layers=32, embed=4096,
                   heads=32, kv_heads=8, mlp=14336, norm_eps=1e-5, rope_theta=500000.0, rope_scaling="llama3",
                   tie_embeddings=False, remat="full")
    c.lora.update(rank=16, alpha=32.0, dropout=0.05, targets="all-linear", base_dtype="bfloat16")
    c.train.update(steps=1000, global_batch_size=16, microbatches=16, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.optim.update(lr=2e-4, min_lr_ratio=0.1, warmup_steps=30, decay_steps=1000, weight_decay=0.0,
                   b1=0.9, b2=0.999, clip_norm=1.0)
    c.data.update(sources="chat.jsonl", packing="bfd", truncate="right", loss_on="auto", val_fraction=0.02)
    c.checkpoint.update(every_steps=250, keep=2)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=250, batches=8)
    return c
