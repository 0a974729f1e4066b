"""Where rank 0's metric rows and the run's events go: metrics.jsonl always, TensorBoard and W&B
when `run.loggers` names them (`sinks.py` fans out to them)."""
