"""jaxpar: GPT training with data, tensor and pipeline parallelism and ZeRO, as one JAX SPMD program."""
