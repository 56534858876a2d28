"""Observability: what a run says while it trains: metrics.jsonl, TensorBoard, Weights & Biases, the console and the
profiler (`monitor.py`)."""
