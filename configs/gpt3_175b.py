"""GPT-3 175B (96 layers, d_model 12288, 96 heads, 2048 tokens; Brown et al. 2020) as Megatron-LM trains it on 1024
A100s: tensor 8 x pipeline 16 (interleaved 1F1B, 2 virtual stages) x data 8, global batch 1536, each stage's forward
recomputed in the backward (pipeline.remat: Megatron's full recompute), bf16.

For planning (`python -m jaxpar.plan --config configs/gpt3_175b.py --gpus 1024`) and `--dry_run` on fake devices;
training it needs a cluster and a real corpus (`--config.data.sources=...`).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "gpt3_175b"
    c.mesh.update(data=8, tensor=8, stage=16)
    c.model.update(vocab_size=51200, seq_len=2048, layers=96, embed=12288, heads=96, tie_embeddings=True)
    c.train.update(steps=300_000, global_batch_size=1536, microbatches=192, param_dtype="float32",
                   compute_dtype="bfloat16")
    c.pipeline.update(schedule="1f1b", virtual_stages=2, remat=True)
    c.optim.update(lr=6e-5, min_lr_ratio=0.1, warmup_steps=2000, decay_steps=300_000, weight_decay=0.1,
                   b1=0.9, b2=0.95, clip_norm=1.0)
    c.data.update(sources="shakespeare", tokenizer="bpe", bpe_vocab_size=51200)
    c.checkpoint.update(every_steps=500, keep=3)
    return c
