"""Checkpoints: sharded DCP saves, their manifest and completeness, resuming, inspecting, export.

Layout: RUN_DIR/checkpoints/step-00000008/ holds DCP's shard files (`__<rank>_0.distcp`), DCP's
`.metadata`, and `manifest.json`, which rank 0 writes last (paths: `fsdprun.rundir`).

- `manifest`: write, read and validate manifest.json; whether a checkpoint is complete
  (no process group, no tensor data);
- `save`: the `Checkpointer` (sync and async saves, keep-last, a failed save reported alike on
  every rank) and the state it saves;
- `restore`: which checkpoint to resume from, loading it, setting later ones aside;
- `inspect`, `export`: offline commands over a checkpoint folder.

The names other packages use are re-exported here, each loaded on first use.

The package never imports the training loop (`train`) nor the launcher (`launch`); the run
directory's names come from `fsdprun.rundir`: `inspect` and `export` read a folder without them.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdprun.checkpoint.manifest import (
        CheckpointStatus,
        check_checkpoint,
        list_checkpoints,
        read_manifest,
        verify_checkpoint,
    )
    from fsdprun.checkpoint.restore import (
        find_resume_checkpoint,
        load_checkpoint,
        load_model_weights,
        set_aside_after,
    )
    from fsdprun.checkpoint.save import (
        Checkpointer,
        SaveFailed,
        SaveRecord,
        build_state,
        new_checkpoint_group,
    )
    from fsdprun.rundir import checkpoint_root, step_dir

# Each name is imported from its module when first used, not when the package loads: importing
# `fsdprun.checkpoint.inspect` (which `inspect-checkpoint` does) must not load `save` and
# `restore`, and with them torch.distributed (several seconds on a small machine).
_HOMES = {
    "fsdprun.checkpoint.manifest": ("CheckpointStatus", "check_checkpoint", "list_checkpoints",
                                    "read_manifest", "verify_checkpoint"),
    "fsdprun.checkpoint.restore": ("find_resume_checkpoint", "load_checkpoint",
                                   "load_model_weights", "set_aside_after"),
    "fsdprun.checkpoint.save": ("Checkpointer", "SaveFailed", "SaveRecord", "build_state",
                                "new_checkpoint_group"),
    "fsdprun.rundir": ("checkpoint_root", "step_dir"),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str):
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME_OF[name]), name)


__all__ = [
    "CheckpointStatus",
    "Checkpointer",
    "SaveFailed",
    "SaveRecord",
    "build_state",
    "check_checkpoint",
    "checkpoint_root",
    "find_resume_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "new_checkpoint_group",
    "read_manifest",
    "set_aside_after",
    "step_dir",
    "verify_checkpoint",
]
