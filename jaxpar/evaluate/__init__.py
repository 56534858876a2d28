"""lm-evaluation-harness over jaxpar: `lm.JaxparLM` (lm-eval's `LM`, registered as `jaxpar`), `scores` (requests
scored by the layout's engine), `python -m jaxpar.evaluate` (the command line), `during` (tasks during training)."""
