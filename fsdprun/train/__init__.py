"""One worker process of a run: its lifecycle (`worker`), the training step and loop (`loop`),
the train state that checkpoints keep (`state`), the optimizer and schedule (`optim`), failure
watching (`guard`) and the profiler (`profiling`); the loss functions are the ground floor's
(`fsdprun.loss`). Imported by the launcher's
workers only: the CLI never loads it before a run."""
