"""CPU DPO quickstart (docs/finetune.md#dpo): the fine-tuning quickstart's run repeated on noisy replies (half of them
echo the word: `--config.data.sources=data/finetune_demo/noisy_train.jsonl`, exported to
exports/finetune_demo_noisy), then trained on preference pairs that prefer the reversed word to the echoed one
(`prefs_train.jsonl` of `python scripts/finetune_demo.py make`): beta 0.5, lr 1e-4, 100 steps of 32 pairs, the
reference model the starting weights. The layout and data settings are configs/finetune_demo.py's.
"""
from jaxpar.config import config_beside


def get_config():
    c = config_beside(__file__, "finetune_demo.py")
    c.name = "finetune_demo_dpo"
    c.init_from = "hf:exports/finetune_demo_noisy"
    c.train.update(objective="dpo", steps=100)
    c.dpo.update(beta=0.5)
    c.optim.update(lr=1e-4, warmup_steps=10, decay_steps=100)
    c.data.update(sources="data/finetune_demo/prefs_train.jsonl")
    c.log.update(every_steps=10)
    c.eval.update(every_steps=50)
    return c
