"""Reinforcement learning with verifiable rewards (`train.objective=grpo`): a round's advantages from its rewards and
its training batch (`advantages.py`); the loss is the objective `jaxpar/train/objectives/grpo.py`."""
