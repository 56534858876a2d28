"""CPU RL quickstart, step 2 (docs/rl.md): GRPO on the SFT run of configs/rl_demo_sft.py, rewarded by the exact answer.

Each step takes 16 prompts of `train.jsonl` ("What is 23+45?", solution "68"), samples 8 completions of each at
temperature 1 with the generation engine on the training mesh, scores them with `jaxpar.rl.rewards:exact_answer`
(math-verify against the record's `solution`, which reaches the reward function as a keyword) and trains on the group
advantages (TRL's defaults otherwise: the `dapo` loss, clip 0.2, no KL term, one pass per round). A completion is the
answer's digits and the end-of-turn token, so 8 new tokens leave room; a prompt is 33 tokens (ChatML), and seq_len 48
holds prompt and completion. The validation split is val.jsonl, the held-out problems `score` reports.

The control run: `--config.grpo.rewards=scripts/rl_demo.py:shuffled_answer --workdir runs/rl_demo_grpo_control`
(the same rewards, permuted among the round's completions). (data, tensor) = (4, 2) on 8 fake CPU devices: the
completions are generated tensor-parallel on the training mesh. lr and steps are not measured yet.
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "rl_demo_grpo"
    c.init_from = "runs/rl_demo_sft"  # the SFT run directory: its latest checkpoint, model shape and tokenizer
    c.model.update(seq_len=48)
    c.mesh.update(data=4, tensor=2)
    c.train.update(objective="grpo", steps=100, global_batch_size=16, microbatches=1, seed=0)
    c.grpo.update(rewards="jaxpar.rl.rewards:exact_answer", num_generations=8, max_completion_length=8,
                  temperature=1.0, top_p=1.0, top_k=0, num_iterations=1, loss_type="dapo", scale_rewards="group",
                  beta=0.0, epsilon=0.2)
    c.optim.update(lr=1e-4, min_lr_ratio=1.0, warmup_steps=5, decay_steps=100, weight_decay=0.0, clip_norm=1.0)
    c.data.update(sources="data/rl_demo/train.jsonl", val_source="data/rl_demo/val.jsonl")
    c.checkpoint.update(every_steps=50, keep=2)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=50, batches=2)
    return c
