"""Offline analysis commands that read recipes, run folders and the engine and model specs:
`plan` (per-rank memory before launching), `compare` (several configurations side by side) and
`status` (a run's state from its folder).

The package never imports the launcher's workers nor the training loop (`train`, `launch`): it
reads, it does not run. The run directory's names and locks and the loss's description are the
ground floor's (`fsdprun.rundir`, `fsdprun.runlock`, `fsdprun.loss`).
"""
