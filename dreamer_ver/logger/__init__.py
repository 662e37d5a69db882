"""The logger: episodes, scores and metrics from every component, written to
`metrics.jsonl`, `scores.jsonl`, TensorBoard and W&B."""
