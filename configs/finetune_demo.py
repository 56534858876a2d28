"""CPU fine-tuning quickstart (docs/finetune.md): the tiny Llama checkpoint of `scripts/finetune_demo.py make`
fine-tuned on its instructions ("Reverse the word: lamp" -> "pmal"), the loss on the assistant's replies only.

Conversations are packed whole (best-fit decreasing) into rows of seq_len + 1 tokens; (data, tensor) = (4, 2) on 8
fake CPU devices. Make the material first: `python scripts/finetune_demo.py make --out data/finetune_demo`.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "finetune_demo"
    c.init_from = "hf:data/finetune_demo/base"
    c.model.update(seq_len=128)
    c.mesh.update(data=4, tensor=2)
    c.train.update(steps=500, global_batch_size=32, microbatches=1, seed=0)
    c.optim.update(lr=2e-3, min_lr_ratio=0.1, warmup_steps=100, decay_steps=500, weight_decay=0.0, clip_norm=1.0)
    c.data.update(sources="data/finetune_demo/train.jsonl", packing="bfd", loss_on="auto", val_fraction=0.02)
    c.checkpoint.update(every_steps=250, keep=2)
    c.log.update(every_steps=50)
    c.eval.update(every_steps=250, batches=2)
    return c
