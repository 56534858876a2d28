"""External formats in and out of a run: Hugging Face checkpoints (`hf/`), PEFT adapters (`peft.py`), Hub names
resolved into the local cache (`hub.py`)."""
