"""Generation on the training mesh: batched decoding of ragged prompts with per-row positions, samplers, stops and
log-probs (`engine.py`, its public API at the top), the KV cache and decode layout (`cache.py`), one loader of a
model source (`source.py`) and the batch command line (`python -m jaxpar.generate`). Guide: docs/generate.md."""
