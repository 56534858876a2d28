"""CPU GRPO quickstart (docs/rl.md): the DPO quickstart's start, the fine-tuning quickstart's run repeated on noisy
replies (half of them echo the word: `runs/finetune_demo_noisy`, which reverses about a quarter of the held-out words
and echoes a fifth), trained with GRPO on the reverse instruction, rewarded by the exact answer
(`jaxpar.rl.rewards:exact_match`: the reply equals the reversed word).

Each step takes 16 prompts of `prompts_train.jsonl` ("Reverse the word: lamp", solution "pmal"), samples 8
completions of each at temperature 1 with the generation engine on the training mesh ((data, tensor) = (4, 2):
tensor-parallel sampling), scores them and trains on the group advantages: TRL's defaults otherwise (the `dapo`
loss, clip 0.2, no KL term, one pass per round). A completion is at most 6 letters and the end-of-turn token: 8 new
tokens leave room; prompts are up to 79 tokens (ChatML, a system message in every fourth), so seq_len 96 holds
both. The held-out prompts are `prompts_val.jsonl`'s (val.jsonl's words).

The control: `--config.grpo.rewards=scripts/finetune_demo.py:shuffled_match` (the same rewards, permuted among the
round's completions).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "finetune_demo_grpo"
    c.init_from = "runs/finetune_demo_noisy"  # the SFT run directory: its latest checkpoint, shape and tokenizer
    c.model.update(seq_len=96)
    c.mesh.update(data=4, tensor=2)
    c.train.update(objective="grpo", steps=100, global_batch_size=16, microbatches=1, seed=0)
    c.grpo.update(rewards="jaxpar.rl.rewards:exact_match", num_generations=8, max_completion_length=8,
                  temperature=1.0, loss_type="dapo", scale_rewards="group", beta=0.0, epsilon=0.2)
    c.optim.update(lr=1e-4, min_lr_ratio=1.0, warmup_steps=5, decay_steps=100, weight_decay=0.0, clip_norm=1.0)
    c.data.update(sources="data/finetune_demo/prompts_train.jsonl", val_source="data/finetune_demo/prompts_val.jsonl")
    c.checkpoint.update(every_steps=50, keep=2)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=50, batches=2)
    return c
