"""What users see of a run: rich tables and progress on the console (`console`), the
metrics.jsonl event log (`metrics`), TensorBoard / W&B (`trackers`) and PNG plots (`plot`).

The package renders and records what others compute: it never imports the engines nor the training
loop (`engines`, `train`; tests/test_imports.py).
"""
