"""What users see of a run: rich tables and progress on the console (`console`), the
metrics.jsonl event log (`metrics`), TensorBoard / W&B (`trackers`) and PNG plots (`plot`)."""
