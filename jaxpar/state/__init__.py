"""A run's state kept and read back: Orbax checkpoints (`checkpoint.py`, complete or ignored; `save_errors.py`), a
resume's checks (`resume.py`: the fingerprint a checkpoint must match), a WORKDIR read back (`runs.py`: its config,
tokenizer and the params of a checkpoint, with no optimizer built)."""
