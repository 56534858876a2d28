"""What leaves and enters a run: Orbax checkpoints, a WORKDIR read back, Hugging Face in and out."""
