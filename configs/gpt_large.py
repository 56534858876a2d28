"""GPT-2 large (774M: 36 layers, d_model 1280, 20 heads, 1024 tokens) for one 8-GPU server: tensor 4 x data 2.

Tensor parallelism stays inside groups of 4 neighbouring GPUs (NVLink); data parallelism across the two groups.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "gpt_large"
    c.mesh.update(data=2, tensor=4, stage=1)
    c.model.update(seq_len=1024, layers=36, embed=1280, heads=20, mlp=5120, tie_embeddings=True, remat="dots")
    c.train.update(steps=300_000, global_batch_size=512, microbatches=16, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.optim.update(lr=2.5e-4, min_lr_ratio=0.1, warmup_steps=2000, decay_steps=300_000, weight_decay=0.1,
                   b1=0.9, b2=0.95, clip_norm=1.0)
    c.data.update(sources="shakespeare", tokenizer="bpe", bpe_vocab_size=32768, val_fraction=0.01)
    c.checkpoint.update(every_steps=1000, keep=3)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=1000, batches=20)
    return c
