"""CPU RL quickstart, step 1 (docs/rl.md): a short SFT of the tiny Llama checkpoint of `scripts/rl_demo.py make` on
two-number additions ("What is 23+45?" -> "68"), stopped early on purpose: the model leaves it with partial skill,
so that GRPO (configs/rl_demo_grpo.py) has right and wrong answers to compare.

200 steps of 32 rows (about 96 conversations each: 10 passes over sft.jsonl's 2,000) at lr 3e-3: the loss on the
replies falls from 1.87 (step 25) to a plateau near 1.3 and leaves it at step ~130; stopped at 200 (loss 0.74), the
greedy replies of val.jsonl are 26 % right (`scripts/rl_demo.py score`), and 8 samples of a prompt at temperature 1
disagree on about half the prompts. The skill comes fast once the plateau is left: 170 steps (decay over 170) give
10 %, 250 give 76 %.

Conversations are packed whole (best-fit decreasing) into rows of seq_len + 1 tokens (three to a row); data = 8 on 8
fake CPU devices. Make the material first: `python scripts/rl_demo.py make --out data/rl_demo`.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "rl_demo_sft"
    c.init_from = "hf:data/rl_demo/base"
    c.model.update(seq_len=128)
    c.mesh.update(data=8)
    c.train.update(steps=200, global_batch_size=32, microbatches=1, seed=0)
    c.optim.update(lr=3e-3, min_lr_ratio=0.1, warmup_steps=20, decay_steps=200, weight_decay=0.0, clip_norm=1.0)
    c.data.update(sources="data/rl_demo/sft.jsonl", packing="bfd", loss_on="auto", val_fraction=0.02)
    c.checkpoint.update(every_steps=200, keep=1)
    c.log.update(every_steps=25)
    c.eval.update(every_steps=200, batches=2)
    return c
