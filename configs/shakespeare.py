"""CPU quickstart: a small byte-level GPT on Shakespeare's plays, float32, all devices on `data` by default.

Layers and heads are divisible by 4 so (data, tensor, stage) layouts up to 4-way tensor or pipeline fit.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "shakespeare"
    c.model.update(seq_len=128, layers=4, embed=128, heads=4, mlp=512, tie_embeddings=True)
    c.train.update(steps=1000, global_batch_size=32, microbatches=1, seed=0,
                   param_dtype="float32", compute_dtype="float32")
    c.optim.update(lr=2e-3, min_lr_ratio=0.1, warmup_steps=100, decay_steps=1000, weight_decay=0.1,
                   b1=0.9, b2=0.99, clip_norm=1.0)
    c.data.update(sources="shakespeare", tokenizer="byte", val_fraction=0.05)
    c.checkpoint.update(every_steps=250, keep=3)
    c.log.update(every_steps=25)
    c.eval.update(every_steps=100, batches=8)
    return c
