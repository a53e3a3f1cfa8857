"""A persistent gloo process group for engine-level tests: worker processes started once per
session, to which tests submit functions, instead of a `fsdprun train` launch each.

A launch spends most of its seconds on what every launch repeats (the launcher importing torch
and fsdprun, the rendezvous, the workers' process group, the teardown); a test that checks what
an engine, the loop or the model state does with a recipe needs none of that. `GlooPool.train`
runs the worker's own `_train` (the same build, data, loop, checkpointing and metrics as a
launched rank) in the pool's ranks on a run directory prepared as the launcher prepares it, and
returns a `Run` read from its metrics. Tests of the launch itself (faults, resume, signals,
reporting) keep launching `fsdprun`.

The group is real: gloo over a FileStore, one process per rank, spawned (not forked from pytest).
A task that fails on any rank (or outlasts its timeout) ends the pool; the next task starts a
fresh one, so one failure cannot leave the others waiting in a collective.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import traceback
from datetime import timedelta
from pathlib import Path

from conftest import Run

TIMEOUT_S = 300.0


def _serve(rank: int, world: int, store_path: str, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    gc.disable()
    import torch
    import torch._dynamo  # noqa: F401 (loaded on the first model built, as in a launched rank)
    import torch.distributed as dist

    import fsdprun.train.worker  # noqa: F401

    # What every task uses, frozen as a launched rank has it (fsdprun.cli, the launcher's fork):
    # the full collection after each task then walks the task's objects only, not torch's
    # (0.2 CPU s a task and rank).
    gc.freeze()
    gc.enable()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S)
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        finally:
            gc.collect()
    dist.destroy_process_group()


class PoolTaskFailed(AssertionError):
    pass


class GlooPool:
    """`world` ranks in one gloo process group, started on first use and kept for the session."""

    def __init__(self, world: int, root: Path):
        self.world, self.root = world, root
        self.procs: list = []
        self.tasks: list = []
        self.starts = 0
        self.cache: dict[tuple, object] = {}

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.starts += 1
        store = self.root / f"store{self.starts}"
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.world, str(store), self.tasks[r],
                                             self.results), daemon=True)
            for r in range(self.world)
        ]  # fmt: skip
        for p in self.procs:
            p.start()

    def close(self) -> None:
        """Ask each rank to leave; kill what does not (a rank keeps the loop's signal handlers,
        which turn a SIGTERM into a stop request)."""
        for q, p in zip(self.tasks, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
        self.procs, self.tasks = [], []  # a later submit starts afresh (and may close again)

    def submit(self, fn, *args, timeout: float = TIMEOUT_S) -> list:
        """fn(rank, world, *args) on every rank (a module-level function); its results by rank."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for q in self.tasks:
            q.put((fn, args))
        got: dict[int, object] = {}
        failures = []
        try:
            while len(got) + len(failures) < self.world:
                rank, ok, value = self.results.get(timeout=timeout)
                if ok:
                    got[rank] = value
                else:
                    failures.append(f"rank {rank}:\n{value}")
        except queue.Empty:
            failures.append(f"no answer within {timeout:.0f} s (ranks answered: {sorted(got)})")
        if failures:
            self.close()  # the others may wait in a collective: start afresh next time
            raise PoolTaskFailed("\n".join(failures))
        return [got[r] for r in range(self.world)]

    def train(self, *overrides: str, recipe: str = "debug", env: dict[str, str] | None = None):
        """The recipe trained by the pool's ranks as launched ranks train it, cached by its
        arguments for the session (as conftest's `fsdprun_runs`); a conftest `Run` whose `proc`
        is None (nothing was launched; a failure raises `PoolTaskFailed`). `env`: variables the
        ranks see while they train it (as a launch's environment)."""
        from fsdprun.config import load_recipe
        from fsdprun.launch.elastic import prepare_run_dir

        key = (recipe, *overrides, *sorted((env or {}).items()))
        if key not in self.cache:
            run_dir = self.root / f"run{len(self.cache)}"
            resolved = load_recipe(recipe, [*overrides, f"launch.nproc_per_node={self.world}"])
            prepare_run_dir(run_dir, resolved)  # recipe.yaml, as the launcher writes it
            self.submit(_train_rank, str(run_dir), resolved.name, env or {})
            self.cache[key] = PoolRun(None, run_dir)
        return self.cache[key]


def _train_rank(rank: int, world: int, run_dir: str, recipe_name: str, env: dict[str, str]):
    """What `fsdprun.train.worker.run` does on a rank, inside the pool's process group, with
    `env` set for the while."""
    from fsdprun.config import load_recipe
    from fsdprun.device import build_worker_device, resolve_device_kind
    from fsdprun.rundir import recipe_path
    from fsdprun.train import worker

    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        cfg = load_recipe(str(recipe_path(Path(run_dir))), world_size=world).config
        device = build_worker_device(resolve_device_kind(cfg.launch.device.value), rank)
        worker._check_same_start(cfg, None)
        ranks = worker.Ranks(rank, rank, world)
        return worker._train(cfg, Path(run_dir), ranks, device, render=False,
                             recipe_name=recipe_name, resume_from=None)  # fmt: skip
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class PoolRun(Run):
    """A run the pool trained: it succeeded, or `GlooPool.train` raised."""

    def check(self):
        return self
