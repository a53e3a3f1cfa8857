"""Starting workers: how this process was started, from the flags and the environment (`modes`:
torchrun, srun, Kubeflow's and torchrun's PET_*, SkyPilot), the in-process elastic launcher
(`elastic`), running under torchrun or srun (`direct`, `slurm`), the waits of a multi-node
rendezvous (`rendezvous`) and `fsdprun resume` (`resume`). The run directory's names
(`fsdprun.rundir`) and its lock (`fsdprun.runlock`) sit at the package's ground floor, since
checkpoint, config, report and tools read them too; so do the single-node loopback sockets
(`fsdprun.loopback`) and the launch mode's variable (`fsdprun.children.MODE_ENV`), which the
workers use too.

The package never imports the models, nor the engines but what the launcher checks before any
worker starts (float8's device check, `engines.preflight`'s model check): workers
(`train.worker`) build them.
"""
