"""Starting workers: the in-process elastic launcher (`elastic`), running under torchrun or srun
(`direct`, `slurm`), the single-node loopback rendezvous (`loopback`), one run per directory
(`runlock`) and `fsdprun resume` (`resume`)."""
