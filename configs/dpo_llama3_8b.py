"""DPO of Llama 3 8B after SFT, on one 8-GPU server (H100/H200 80+ GB): `configs/sft_llama3_8b.py`'s model and layout
(ZeRO 3 over data 8, float32 weights and AdamW moments, bf16 compute, full recompute, 4096-token rows) trained on
preference pairs (`prompt`, `chosen`, `rejected`) with the sigmoid loss, beta 0.1, lr 5e-7 (Zephyr's and TRL's usual
settings), 64 rows of pairs per step. The reference model is the starting checkpoint; its log-probs are computed once
before training (`dpo.precompute_reference`), so no second copy of the weights is held (docs/finetune.md#dpo).

The shape is Llama 3 8B's, so `--dry_run` needs no checkpoint; to train, point it at the SFT checkpoint and the pairs:
    --config.init_from=hf:/path/to/Llama-3.1-8B-Instruct --config.data.sources=/path/to/pairs.jsonl
"""
from jaxpar.config import config_beside


def get_config():
    c = config_beside(__file__, "sft_llama3_8b.py")
    c.name = "dpo_llama3_8b"
    c.train.update(objective="dpo", steps=1000)
    c.dpo.update(beta=0.1, loss="sigmoid", precompute_reference=True)
    c.optim.update(lr=5e-7, min_lr_ratio=0.0, warmup_steps=100, decay_steps=1000)
    c.data.update(sources="pairs.jsonl")
    return c
