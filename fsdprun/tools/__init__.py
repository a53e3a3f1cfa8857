"""Offline analysis commands that read recipes, run folders and the engine and model specs:
`plan` (per-rank memory before launching), `compare` (several configurations side by side) and
`status` (a run's state from its folder).

The package never imports the launcher's workers nor the training loop (`train`, but for
`train.loss`'s description of the loss; `launch` but for run-directory names and locks): it reads,
it does not run.
"""
