"""The combination matrix: a pairwise covering set of real CPU runs over the recipe's axes.

Every combination fsdprun accepts must train with fp32 losses equal to the plain fsdp2 run of the
same model and data (1e-5), or, where the recipe asks for something an engine or this machine
cannot do, be refused before anything starts: one line, exit 2, an empty run directory. It must
never crash mid-run.

The axes are one table (`AXES`): adding an axis is one line there plus what it sets in `_args`.
Tensor parallelism (`tp`) is a sparse axis: the covering set runs at tp 1, and `TP_CELLS` adds
two tp-2 cells (4 ranks: tp 2 x dp 2) over different values of the other axes, checked against
the same plain references; its refusals are `REFUSED` rules like any other.
`NOT_APPLICABLE` lists value pairs that describe no run (a tied HuggingFace folder is the folder's
own business). `REFUSED` lists pairs fsdprun refuses, with the words the refusal must contain; the
covering set of trained cells avoids them, and one cell per rule checks the refusal itself.

The cells run under the `matrix` marker (part of the default run and of CI; deselect with
`-m "not matrix"` while iterating). A session fixture launches every cell two at a time and
trains every distinct reference (one world-1 fsdp2 fp32 run per model, data and tying) in a
persistent one-rank gloo process group; each cell's test checks its own result.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import Run, free_port, fsdprun_env, run_fsdprun, zygote_command

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

AXES: dict[str, list] = {
    "engine": ["fsdp2", "fsdp1", "ddp"],
    "sharding": ["full", "grad_op", "hybrid", "hybrid_zero2", "none"],
    "precision": ["fp32", "bf16", "fp16"],
    "accum": [1, 2],
    "tied": [False, True],
    "model": ["builtin", "hf_fp32", "hf_bf16"],
    "data": ["synthetic", "tokens", "text"],
    "ac": ["none", "full"],
    "offload": [False, True],
    "resume": ["none", "other_world"],
    "launch": ["fsdprun", "torchrun", "srun"],
}

# Value pairs that describe no run at all.
NOT_APPLICABLE = [
    # An HF folder's tying comes from its config.json, not from model.tie_embeddings.
    ({"tied": True}, {"model": "hf_fp32"}),
    ({"tied": True}, {"model": "hf_bf16"}),
    # `fsdprun resume` is the launcher's command; torchrun/srun users rerun `fsdprun train`.
    ({"resume": "other_world"}, {"launch": "torchrun"}),
    ({"resume": "other_world"}, {"launch": "srun"}),
]

# The sparse tp axis: the covering set's cells run at tp 1; these cells at tp 2 (a 4-rank
# tp 2 x dp 2 mesh), each with other values of the other axes. One resumes on 2 ranks (tp 2 x
# dp 1, through a checkpoint saved on the 2 x 2 mesh).
TP_AXIS = [1, 2]
TP_CELLS = [
    {"engine": "fsdp2", "sharding": "full", "precision": "fp32", "accum": 2, "tied": False,
     "model": "builtin", "data": "text", "ac": "full", "offload": False,
     "resume": "other_world", "launch": "fsdprun", "tp": 2},
    {"engine": "fsdp2", "sharding": "grad_op", "precision": "bf16", "accum": 1, "tied": False,
     "model": "builtin", "data": "tokens", "ac": "none", "offload": False, "resume": "none",
     "launch": "torchrun", "tp": 2},
]  # fmt: skip

# Value pairs fsdprun refuses before launch, and what the one line must name.
REFUSED = [
    (({"engine": "fsdp1"}, {"tp": 2}), "fsdp.engine=fsdp1 cannot shard DTensor"),
    (({"engine": "ddp"}, {"tp": 2}), "fsdp.engine=ddp cannot shard DTensor"),
    (({"engine": "ddp"}, {"offload": True}), "fsdp.cpu_offload"),
    # FSDP1 pins offloaded parameters, which needs an accelerator.
    (({"engine": "fsdp1"}, {"offload": True}), "fsdp.cpu_offload"),
]


def _matches(cell: dict, part: dict) -> bool:
    return all(cell.get(k) == v for k, v in part.items())


def _pair_rule(cell: dict, rules) -> bool:
    return any(_matches(cell, a) and _matches(cell, b) for a, b in rules)


def _excluded(cell: dict) -> bool:
    return _pair_rule(cell, NOT_APPLICABLE) or _pair_rule(cell, [r for r, _ in REFUSED])


def pairwise(axes: dict[str, list], excluded, cell_cost, cost, tries: int = 50) -> list[dict]:
    """A deterministic covering set: every allowed pair of values of two axes appears in at least
    one cell, and no cell is `excluded`. Greedy, over `tries` seeded orders of the pairs and axes;
    returns the set of least `cost` (a cell is a few seconds of launches, so every one saved
    counts). `cell_cost` (of a cell, or of the part of one filled so far) breaks the greedy's
    ties."""
    sets = [_greedy_cover(axes, excluded, cell_cost, random.Random(seed)) for seed in range(tries)]
    return min(sets, key=cost)


def _greedy_cover(axes: dict[str, list], excluded, cell_cost, rng: random.Random) -> list[dict]:
    """Each cell starts from an uncovered pair (picked by `rng`) and fills the other axes, in an
    order `rng` shuffles, with the value that covers the most uncovered pairs, the cheapest of
    those by `cell_cost`, else the first."""
    names = list(axes)
    order = {n: i for i, n in enumerate(names)}
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in axes[a]
        for vb in axes[b]
        if not excluded({a: va, b: vb})
    }
    cells = []
    while uncovered:
        a, va, b, vb = rng.choice(sorted(uncovered, key=repr))
        cell = {a: va, b: vb}
        rest = [n for n in names if n not in cell]
        rng.shuffle(rest)
        for name in rest:
            best, best_key = None, None
            for value in axes[name]:
                trial = {**cell, name: value}
                if excluded(trial):
                    continue
                gain = sum(
                    ((n, cell[n], name, value) if order[n] < order[name] else
                     (name, value, n, cell[n])) in uncovered
                    for n in cell
                )  # fmt: skip
                key = (gain, -cell_cost(trial))
                if best_key is None or key > best_key:
                    best, best_key = value, key
            assert best is not None, f"no allowed value of {name} for {cell}"
            cell[name] = best
        cell = {n: cell[n] for n in names}
        cells.append(cell)
        uncovered -= {(x, cell[x], y, cell[y]) for x, y in itertools.combinations(names, 2)}
    return cells


def _refusal_cells() -> list[tuple[dict, str]]:
    base = {**{n: values[0] for n, values in AXES.items()}, "tp": TP_AXIS[0]}
    return [({**base, **a, **b}, words) for (a, b), words in REFUSED]


def test_the_covering_set_covers_every_allowed_pair():
    cells = PAIRWISE
    for a, b in itertools.combinations(AXES, 2):
        for va, vb in itertools.product(AXES[a], AXES[b]):
            if _excluded({a: va, b: vb}):
                assert not any(c[a] == va and c[b] == vb for c in cells)
            else:
                assert any(c[a] == va and c[b] == vb for c in cells), (a, va, b, vb)
    # Refused pairs are covered by a refusal cell of their own.
    refused = [cell for cell, _ in _refusal_cells()]
    for (a, b), _ in REFUSED:
        assert any(_matches(c, a) and _matches(c, b) for c in refused)
    # The tp cells are allowed cells, each of both tp values appears.
    assert not any(_excluded(c) for c in TP_CELLS)
    assert {c["tp"] for c in CELLS} == set(TP_AXIS)
    # Each launch is seconds of CI time: the cells, resumed ones twice, and their references. The
    # pairs themselves need 5 torchrun cells and 5 resumed ones (each meets the 5 shardings) and
    # 6 of 4 ranks (each hybrid sharding meets 3 engines): the set has no more of those.
    assert len(cells) <= 18 and _launches(cells) <= 32, (len(cells), _launches(cells))
    assert sum(_world(c) == 4 for c in cells) == 6
    assert sum(c["launch"] == "torchrun" for c in cells) == 5
    assert sum(c["resume"] != "none" for c in cells) == 5
    assert _launches(CELLS) <= _launches(cells) + 5


STEPS = 4


def _cell_id(cell: dict) -> str:
    return "-".join(str(v) if not isinstance(v, bool) else (k if v else f"no{k}")
                    for k, v in cell.items())  # fmt: skip


def _world(cell: dict) -> int:
    # Hybrid modes get two shard groups of 2 (a 2 x 2 mesh), tp 2 a tp 2 x dp 2 mesh, the rest
    # 2 ranks.
    hybrid = cell.get("sharding") in ("hybrid", "hybrid_zero2")
    return 4 if hybrid or cell.get("tp", 1) > 1 else 2


def _dp(cell: dict) -> int:
    return _world(cell) // cell.get("tp", 1)


def _resume_world(cell: dict) -> int:
    return 2 if _world(cell) == 4 else 1


@pytest.fixture(scope="session")
def hf_bf16_folder(tmp_path_factory) -> Path:
    """The shipped tiny HF model with config.json saying torch_dtype bfloat16 (the weights stay
    the fp32 ones, so its losses must equal the fp32 folder's)."""
    folder = tmp_path_factory.mktemp("hf-bf16") / "tiny-llama-hf"
    shutil.copytree(RECIPES / "data" / "tiny-llama-hf", folder)
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _model_data_args(cell: dict, hf_bf16: Path) -> list[str]:
    # The byte tokenizer's 257 tokens at tp 2 too: the vocab shards unevenly (129 + 128 rows).
    args = ["model.vocab_size=257", f"model.tie_embeddings={str(cell['tied']).lower()}"]
    if cell["model"] == "hf_fp32":
        args += [f"model.hf_path={RECIPES / 'data' / 'tiny-llama-hf'}", "model.init=pretrained"]
    elif cell["model"] == "hf_bf16":
        args += [f"model.hf_path={hf_bf16}", "model.init=pretrained"]
    if cell["data"] == "tokens":
        args += ["data.source=tokens", f"data.paths=[{RECIPES / 'data' / 'tiny' / 'train.bin'}]"]
    elif cell["data"] == "text":
        args += ["data.source=text", f"data.paths=[{RECIPES / 'data' / 'tiny.txt'}]",
                 "data.tokenizer=byte", "data.val_fraction=0.0"]  # fmt: skip
    return args


COMMON = [f"train.steps={STEPS}", "train.global_batch_size=8", "output.log_every=1",
          "eval.every_steps=0", "schedule.warmup_steps=1", "optim.weight_decay=0.1",
          "checkpoint.save_final=false"]  # fmt: skip


def _args(cell: dict, hf_bf16: Path) -> list[str]:
    micro = 8 // (_dp(cell) * cell["accum"])
    precision = cell["precision"]
    args = [
        *COMMON,
        *_model_data_args(cell, hf_bf16),
        f"fsdp.engine={cell['engine']}",
        f"fsdp.sharding={cell['sharding']}",
        f"precision.param_dtype={precision}",
        "precision.reduce_dtype=fp32",
        f"train.micro_batch_size={micro}",
        f"activation_checkpointing.mode={cell['ac']}",
        f"fsdp.cpu_offload={str(cell['offload']).lower()}",
    ]
    if cell["sharding"] in ("hybrid", "hybrid_zero2"):
        args.append("fsdp.shard_group_size=2")
    if cell["tp"] > 1:
        args.append(f"parallel.tp={cell['tp']}")
    if cell["resume"] != "none":
        args.append("checkpoint.every_steps=2")
    return args


def _launch(cell: dict, args: list[str], run_dir: Path, cwd: Path, env: dict) -> list:
    """Start the run as the cell's launch says; returns the completed processes."""
    world = _world(cell)
    # torchrun's workers and srun's tasks are `fsdprun` commands through the suite's warm zygote
    # (tests/zygote.py; each its own process, as run_fsdprun's): a torch import less per rank.
    fsdprun = zygote_command(cwd)
    if cell["launch"] == "fsdprun":
        return [run_fsdprun("train", "debug", *args, "--nproc-per-node", str(world),
                            "--run-dir", str(run_dir), cwd=cwd, env=env)]  # fmt: skip
    if cell["launch"] == "torchrun":
        torchrun = str(Path(sys.executable).parent / "torchrun")
        return [subprocess.run(
            [torchrun, "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "127.0.0.1:0", fsdprun, "train", "debug", *args,
             "--run-dir", str(run_dir)],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
        )]  # fmt: skip
    # srun: one task per rank, SLURM's variables only (srun sets no RANK/WORLD_SIZE).
    port = str(free_port())
    procs = []
    for rank in range(world):
        task_env = {**env, "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0",
                    "SLURM_STEP_NUM_TASKS": str(world), "SLURM_NTASKS": str(world),
                    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "cn1",
                    "SLURM_STEP_TASKS_PER_NODE": str(world), "SLURM_NODEID": "0",
                    "SLURMD_NODENAME": "cn1", "SLURM_PROCID": str(rank),
                    "SLURM_LOCALID": str(rank),
                    # Cells run side by side on one host: a free port instead of the job's.
                    "MASTER_PORT": port}  # fmt: skip
        procs.append(subprocess.Popen(
            [fsdprun, "train", "debug", *args, "--run-dir", str(run_dir)], cwd=cwd,
            env=task_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _reference_args(cell: dict, hf_bf16: Path) -> tuple[str, ...]:
    """The plain run of the same model and data: fsdp2, full sharding, fp32, one rank."""
    plain = {**cell, "engine": "fsdp2", "sharding": "full", "precision": "fp32", "accum": 1,
             "ac": "none", "offload": False}  # fmt: skip
    # hf_bf16 holds the fp32 folder's weights: its reference is the fp32 folder's run.
    model = "hf_fp32" if cell["model"] == "hf_bf16" else cell["model"]
    return (*COMMON, *_model_data_args({**plain, "model": model}, hf_bf16),
            "train.micro_batch_size=8")  # fmt: skip


def _launches(cells: list[dict]) -> int:
    """A launch per cell (two for a resumed one) and one per distinct reference run (not a
    launch now, but still a run)."""
    refs = {_reference_args(c, Path("hf-bf16")) for c in cells}
    return len(refs) + sum(1 + (c["resume"] != "none") for c in cells)


def _cell_cost(cell: dict) -> int:
    """A cell's cost in rank starts (of a cell, or of the part of one filled so far): measured
    on the 2-core machine, each rank of a launch costs about 0.55 CPU s (2 ranks 1.1 s, 4 ranks
    2.3 s), and torchrun's agent, a fresh interpreter importing torch, 2 ranks more (3.0 s for
    2 ranks); a resumed cell launches again, on `_resume_world` ranks."""
    cost = _world(cell) + 2 * (cell.get("launch") == "torchrun")
    if cell.get("resume", "none") != "none":
        cost += _resume_world(cell)
    return cost


def _cost(cells: list[dict]) -> float:
    """What a covering set costs: its cells' rank starts, and a little for each distinct
    reference (a run in the one-rank gloo pool: no launch)."""
    refs = {_reference_args(c, Path("hf-bf16")) for c in cells}
    return sum(map(_cell_cost, cells)) + 0.3 * len(refs)


PAIRWISE = [{**cell, "tp": 1} for cell in pairwise(AXES, _excluded, _cell_cost, _cost)]
CELLS = PAIRWISE + TP_CELLS


def _run_cell(cell: dict, hf_bf16: Path, root: Path) -> tuple[list, Path]:
    """Launch one cell as a user would; returns the processes that must succeed and its run
    directory."""
    args = _args(cell, hf_bf16)
    root.mkdir(parents=True)
    run_dir = root / "run"
    if cell["resume"] == "none":
        return _launch(cell, args, run_dir, root, fsdprun_env()), run_dir
    # Crash after step 2's checkpoint, then resume on another number of ranks.
    first = _launch(cell, args, run_dir, root, fsdprun_env(FSDPRUN_FAIL_AT="0:3"))
    if first[0].returncode != 1:
        return first, run_dir  # reported by the cell's test
    resumed = run_fsdprun("resume", str(run_dir), "--nproc-per-node", str(_resume_world(cell)),
                          cwd=root, env=fsdprun_env())  # fmt: skip
    return [resumed], run_dir


@pytest.fixture(scope="session")
def matrix(tmp_path_factory, hf_bf16_folder, gloo_pool_1) -> dict:
    """Every cell, two at a time: a launch spends much of its few seconds starting processes and
    waiting on sockets, so two side by side on the 2-core CI machine take far less than two in a
    row. The distinct references train one after another in the session's one-rank persistent
    gloo process group (tests/gloo_pool.py: the worker's own `_train`, as a launched rank trains;
    what is compared is the training, the launches are the cells'). Each cell's test then checks
    its own result."""
    root = tmp_path_factory.mktemp("matrix")
    refs = sorted({_reference_args(c, hf_bf16_folder) for c in CELLS})

    def references() -> dict[tuple[str, ...], Run]:
        return {args: gloo_pool_1.train(*args) for args in refs}

    # The longest first (a resumed cell launches twice, a hybrid one starts 4 ranks), the
    # one-rank references last: neither thread idles long at the end.
    longest = sorted(
        range(len(CELLS)), key=lambda i: (CELLS[i]["resume"] == "none", -_world(CELLS[i]))
    )
    with ThreadPoolExecutor(max_workers=2) as threads:
        cell_futures = {
            i: threads.submit(_run_cell, CELLS[i], hf_bf16_folder, root / f"cell{i}")
            for i in longest
        }
        ref_future = threads.submit(references)
        return {
            "refs": ref_future.result(),
            "cells": [cell_futures[i].result() for i in range(len(CELLS))],
        }


def _one_line_refusal(proc, words: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def _check_trained(procs, run_dir: Path, ref: Run, precision: str) -> None:
    for p in procs:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = Run(procs[0], run_dir)
    steps = {e["step"]: e["loss"] for e in run.steps}
    losses = [steps[s] for s in range(1, STEPS + 1)]
    assert sum(e["event"] == "start" for e in run.events) >= 1
    assert all(math.isfinite(x) for x in losses), losses
    if precision == "fp32":
        assert losses == pytest.approx(ref.losses, abs=1e-5, rel=1e-5)
    elif precision == "bf16":
        # bf16 follows the fp32 run closely (8 bits of mantissa, fp32 master weights).
        assert losses == pytest.approx(ref.losses, rel=3e-2)
    else:
        # fp16: the same forward; then the dynamic loss scale may skip the first steps (as it
        # backs off from 2**16), so later losses need not follow the fp32 run step for step.
        assert losses[0] == pytest.approx(ref.losses[0], rel=2e-2)
        assert len(set(losses)) > 1  # it took optimizer steps


@pytest.mark.matrix
@pytest.mark.parametrize("index", range(len(CELLS)), ids=[_cell_id(c) for c in CELLS])
def test_cell_trains_like_the_plain_run(index, matrix, hf_bf16_folder):
    cell = CELLS[index]
    procs, run_dir = matrix["cells"][index]
    if cell["resume"] != "none" and len(procs) == 1 and procs[0].args[1] == "train":
        # The first launch should have crashed at step 3 (FSDPRUN_FAIL_AT).
        assert procs[0].returncode == 1, procs[0].stdout[-2000:] + procs[0].stderr[-2000:]
    ref = matrix["refs"][_reference_args(cell, hf_bf16_folder)].check()
    _check_trained(procs, run_dir, ref, cell["precision"])


@pytest.mark.matrix
@pytest.mark.parametrize(
    ("cell", "words"), _refusal_cells(), ids=[_cell_id(c) for c, _ in _refusal_cells()]
)
def test_refused_cell_says_why_before_anything_starts(cell, words, tmp_path, hf_bf16_folder):
    run_dir = tmp_path / "run"
    procs = _launch({**cell, "launch": "fsdprun"}, _args(cell, hf_bf16_folder), run_dir,
                    tmp_path, fsdprun_env())  # fmt: skip
    _one_line_refusal(procs[0], words)
    assert not run_dir.exists() or not any(run_dir.iterdir())
