"""Generation on the training mesh; `source.py`: SRC (a run, an export, hf:DIR, hf:ORG/NAME) -> the model laid out."""
