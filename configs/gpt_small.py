"""GPT-2 small (124M: 12 layers, d_model 768, 12 heads, 1024 tokens) for one GPU server, data parallel.

Point `data.sources` at your text files (`text:GLOB`, see docs/data.md) and `data.tokenizer` at a tokenizer.json (e.g.
GPT-2's), or let jaxpar train a byte-level BPE on the corpus. Global batch 512 x 1024 tokens = 0.5M tokens per step
(GPT-3 paper, Table 2.1, for this size); lr and schedule as nanoGPT's GPT-2 reproduction.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "gpt_small"
    c.mesh.update(data=-1, tensor=1, stage=1)
    c.model.update(seq_len=1024, layers=12, embed=768, heads=12, mlp=3072, tie_embeddings=True, remat="dots")
    c.train.update(steps=600_000, global_batch_size=512, microbatches=8, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.optim.update(lr=6e-4, min_lr_ratio=0.1, warmup_steps=2000, decay_steps=600_000, weight_decay=0.1,
                   b1=0.9, b2=0.95, clip_norm=1.0)
    c.data.update(sources="shakespeare", tokenizer="bpe", bpe_vocab_size=32768, val_fraction=0.01)
    c.checkpoint.update(every_steps=1000, keep=3)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=1000, batches=20)
    return c
