"""Offline analysis commands that read recipes, run folders and the engine and model specs:
`plan` (per-rank memory before launching), `compare` (several configurations side by side) and
`status` (a run's state from its folder)."""
