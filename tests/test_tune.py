"""`fsdprun tune`: the pure logic (space, pruning, halving schedule, selection with noise, the
trial log, tuned.yaml) without launches, then two real searches on CPU (gloo, 2 ranks, each trial
a real `fsdprun train`): one that must move the debug model's 1 x 8 accumulation to a larger
micro-batch that fits the device memory and whose tuned layer trains with the same fp32 losses,
and one that survives a failing trial, a hanging one, a spent budget and a kill -9 of tune.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import fsdprun_env, processes_naming, run_fsdprun, start_fsdprun
from rich.console import Console

from fsdprun.config import DeviceKind, launch_device_problem, load_recipe
from fsdprun.errors import UserError
from fsdprun.tools import tune as T
from fsdprun.tools.tune import nodes as T_nodes
from fsdprun.tools.tune import report as T_report
from fsdprun.tools.tune import search as T_search
from fsdprun.tools.tune import space as T_space
from fsdprun.tools.tune import trials as T_trials

RECIPE = "extends: debug\ntrain:\n  global_batch_size: 16\n  micro_batch_size: 1\n"


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "mb1.yaml"
    path.write_text(RECIPE)
    return path


def cfg_of(recipe: Path, *overrides: str):
    return load_recipe(str(recipe), list(overrides)).config


# ---------------------------------------------------------------------------------------------
# The space


def test_space_keeps_the_math_and_marks_numerics(recipe):
    cfg = cfg_of(recipe)
    with pytest.raises(UserError, match="optim.lr: not a tuning knob"):
        T_space.parse_space(["optim.lr=1e-3,3e-3"], cfg, accelerator=False, allow_numerics=False)
    with pytest.raises(UserError, match="--allow-numerics"):
        T_space.parse_space(
            ["precision.param_dtype=bf16"], cfg, accelerator=False, allow_numerics=False
        )
    with pytest.raises(UserError, match="KEY=V1,V2"):
        T_space.parse_space(
            ["train.micro_batch_size"], cfg, accelerator=False, allow_numerics=False
        )
    space, default = T_space.parse_space(
        ["train.micro_batch_size=2,4", "precision.param_dtype=bf16"], cfg, accelerator=False,
        allow_numerics=True,
    )  # fmt: skip
    assert not default
    # The recipe's own value always joins (the baseline is a candidate).
    assert [(k.key, k.values, k.numerics) for k in space] == [
        ("train.micro_batch_size", ("1", "2", "4"), False),
        ("precision.param_dtype", ("fp32", "bf16"), True),
    ]
    cands = T_space.enumerate_candidates(space, {"train.micro_batch_size": "1",
                                                 "precision.param_dtype": "fp32"})  # fmt: skip
    assert cands[0].diff == {} and cands[0].label == "baseline"
    assert len(cands) == 6 and len({tuple(c.overrides) for c in cands}) == 6
    assert [c.numerics for c in cands] == [False, True, False, True, False, True]


def test_default_space_searches_math_knobs_only(recipe):
    cfg = cfg_of(recipe)
    space, default = T_space.parse_space([], cfg, accelerator=False, allow_numerics=False)
    assert default and {k.key for k in space} <= set(T_space.MATH_KNOBS)
    mb = next(k for k in space if k.key == "train.micro_batch_size")
    assert mb.values == ("1", "2", "4", "8")  # every divisor of 16 / 2 ranks
    # Not a float8 recipe: no float8_all_gather (test_tune_searches_float8_all_gather_...).
    assert "precision.float8_all_gather" not in {k.key for k in space}
    assert "compile.enabled" not in {k.key for k in space}  # CPU: no compile by default
    gpu, _ = T_space.parse_space(["defaults", "fsdp.wrap=block,none"], cfg, accelerator=True,
                                 allow_numerics=False)  # fmt: skip
    keys = {k.key for k in gpu}
    assert "compile.enabled" in keys and "fsdp.wrap" in keys and len(gpu) == len(space) + 2


def test_the_recipes_tune_section_narrows_widens_and_the_command_line_wins(tmp_path, recipe):
    section = tmp_path / "section.yaml"
    knobs = ["train.micro_batch_size: [2, 4]", "fsdp.wrap: [block, none]",
             "fsdp.limit_all_gathers: [True]"]  # fmt: skip
    section.write_text(RECIPE + "tune:\n  space:\n" + "".join(f"    {k}\n" for k in knobs))

    def space(path, items=(), **over):
        cfg = cfg_of(path, *(f"tune.{k}={v}" for k, v in over.items()))
        knobs, default = T_space.parse_space(
            list(items), cfg, accelerator=False, allow_numerics=False
        )
        return {k.key: k.values for k in knobs}, default, T_space.space_sources(list(items), cfg)

    full, _, _ = space(recipe)
    narrowed, default, said = space(section)
    assert default and set(narrowed) == set(full) | {"fsdp.wrap"}  # fsdp.wrap widens it
    assert narrowed["train.micro_batch_size"] == ("1", "2", "4")  # narrowed; baseline joins
    assert narrowed["fsdp.limit_all_gathers"] == ("true",)  # YAML's True is the recipe's true
    assert said == ("the default space, then the recipe's tune.space (train.micro_batch_size, "
                    "fsdp.wrap, fsdp.limit_all_gathers)")  # fmt: skip
    only, default, said = space(section, defaults="false")
    assert not default and set(only) == {"train.micro_batch_size", "fsdp.wrap",
                                         "fsdp.limit_all_gathers"}  # fmt: skip
    assert said.startswith("the recipe's tune.space")
    changed, _, said = space(section, ["defaults", "train.micro_batch_size=8"])
    assert changed["train.micro_batch_size"] == ("1", "8") and "fsdp.wrap" in changed
    assert said.endswith("then --space (train.micro_batch_size)")
    replaced, default, said = space(section, ["train.micro_batch_size=8"])
    assert replaced == {"train.micro_batch_size": ("1", "8")} and not default
    assert said == "--space (train.micro_batch_size), which replaces the rest"
    with pytest.raises(UserError, match="nothing to search"):
        space(recipe, defaults="false")
    with pytest.raises(UserError, match="--space: fsdp.engine value 'fsdp3' is not a valid"):
        space(recipe, ["fsdp.engine=fsdp3"])
    numerics = tmp_path / "numerics.yaml"
    numerics.write_text(RECIPE + "tune:\n  space:\n    precision.param_dtype: [bf16]\n")
    with pytest.raises(UserError, match="tune.space precision.param_dtype: .*--allow-numerics"):
        space(numerics)


def test_none_is_a_value_to_search_on_the_command_line_and_in_the_recipe(tmp_path):
    """YAML reads `none` as a string, which fsdp.wrap, activation_checkpointing.mode and
    fsdp.backward_prefetch take as a value: it stays one, never becomes null."""
    path = tmp_path / "section.yaml"
    path.write_text(RECIPE + "tune:\n  defaults: false\n  space:\n"
                    "    fsdp.backward_prefetch: [pre, none]\n")  # fmt: skip
    args = tune_cmd(path, tmp_path / "o", "--device-memory", "1GB", "--dry-run", "--json",
                    "--space", "defaults", "--space", "fsdp.wrap=block,none", "--space",
                    "activation_checkpointing.mode=none,full")  # fmt: skip
    proc = run_fsdprun(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert {k["key"]: k["values"] for k in doc["space"]} == {
        "fsdp.backward_prefetch": ["pre", "none"], "fsdp.wrap": ["block", "none"],
        "activation_checkpointing.mode": ["none", "full"],
    }  # fmt: skip
    assert len(doc["candidates"]) == 8
    assert not [c for c in doc["candidates"] if c["status"] == "pruned"], doc["candidates"]


def test_every_value_of_an_enum_knob_is_searchable(recipe):
    """Each value the recipe schema accepts for an enum knob comes out of the space as itself,
    and a candidate that sets it resolves (its own cross-field checks aside)."""
    cfg = cfg_of(recipe)
    checked = 0
    for key in (*T_space.MATH_KNOBS, *T_space.NUMERICS_KNOBS):
        section, name = key.split(".", 1)
        default = getattr(getattr(cfg, section), name)
        if not isinstance(default, enum.Enum):
            continue
        values = [m.value for m in type(default)]
        space, _ = T_space.parse_space([f"{key}={','.join(values)}"], cfg, accelerator=False,
                                       allow_numerics=True)  # fmt: skip
        assert sorted(space[0].values) == sorted(values), key
        for value in values:
            try:
                load_recipe(str(recipe), [f"{key}={value}"])
            except UserError as e:
                assert "Incompatible value" not in str(e) and "not a valid" not in str(e), e
        checked += 1
    assert checked >= 8  # engine, sharding, wrap, prefetch, checkpointing, loss, dtypes, ...


def test_a_bad_tune_section_is_refused_like_any_recipe_key(tmp_path):
    """By the loader every command uses, in one line; `fsdprun train` exits 2 with it."""
    cases = {
        "tune:\n  space:\n    optim.lr: [1e-3]\n": "tune.space: 'optim.lr' is not a tuning knob",
        "tune:\n  space:\n    activation_checkpointing.mode: [some]\n":
            "activation_checkpointing.mode value 'some' is not a valid",
        "tune:\n  space:\n    train.micro_batch_size: []\n": "has no values",
        "tune:\n  spaces: {}\n": "unknown key 'tune.spaces'",
        "tune:\n  defaults: maybe\n": "tune.defaults",
    }  # fmt: skip
    for n, (text, want) in enumerate(cases.items()):
        path = tmp_path / f"bad{n}.yaml"
        path.write_text(RECIPE + text)
        with pytest.raises(UserError) as e:
            load_recipe(str(path), [])
        assert want in str(e.value) and "\n" not in str(e.value), (text, str(e.value))
    from typer.testing import CliRunner

    from fsdprun.cli import app

    result = CliRunner().invoke(app, ["train", str(tmp_path / "bad0.yaml")])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "not a tuning knob" in lines[0]


# ---------------------------------------------------------------------------------------------
# Pruning with the plan


def test_prune_with_the_plan_and_the_knob_table(recipe):
    cfg = cfg_of(recipe)
    space, _ = T_space.parse_space(
        ["train.micro_batch_size=1,3,8", "fsdp.limit_all_gathers=true,false",
         "fsdp.cpu_offload=false,true"],
        cfg, accelerator=False, allow_numerics=False,
    )  # fmt: skip
    base = {k.key: T_space.current_value(cfg, k.key) for k in space}
    cands = T_space.enumerate_candidates(space, base)
    plans = {}

    def planner(c):  # the real plan, remembered for the assertions
        plans[c.train.micro_batch_size, c.fsdp.cpu_offload] = T_space._planned(c)
        return plans[c.train.micro_batch_size, c.fsdp.cpu_offload]

    mb8 = T_space._planned(cfg_of(recipe, "train.micro_batch_size=8"))[0]
    mb1 = T_space._planned(cfg)[0]
    memory = int((mb1 + mb8) / 2)  # mb=1 fits with the margin, mb=8 does not
    assert mb1 * 1.1 < memory < mb8 * 1.1
    T_space.prune(cands, str(recipe), [], device_memory_bytes=memory, margin=0.1,
                  dominate_memory_knobs=False, planner=planner)  # fmt: skip
    why = {c.label: c.reason for c in cands}
    assert all(c.reason for c in cands[1:]), why
    assert "refuse" in why["mb=3"] and "global_batch_size" in why["mb=3"]
    assert "limit_all_gathers does nothing under fsdp2" in why["limit_ag=false"]
    assert "device memory" in why["mb=8"] and "10% margin" in why["mb=8"]
    # Offload is only tried where nothing else fits: mb=1 fits without it.
    assert why["offload=true"] == "fsdp.cpu_offload=true not needed: c0 (without) fits"
    # mb=8 with offload: its planned device peak leaves out the offloaded model state.
    assert plans[8, True][0] < plans[8, False][0]
    assert cands[0].status == "kept"
    order = T_space.prior_order(cands)
    assert order == [cands[0]]


def test_several_nodes_search_hybrid_and_its_shard_group_only_where_it_acts(recipe):
    launch = ["launch.nnodes=4", "launch.nproc_per_node=1", "launch.rdzv_endpoint=h:1"]
    cfg = cfg_of(recipe, *launch)
    space = {k.key: k.values for k in T_space.default_space(cfg, accelerator=False)}
    assert space["fsdp.sharding"] == ("full", "grad_op", "hybrid", "hybrid_zero2")
    assert space["fsdp.shard_group_size"] == ("null", "2")  # one node's ranks, or two nodes'
    # Under cp (and tp) the key counts data-parallel ranks: two nodes of 4 ranks at cp 2 are 4.
    cp2 = ["launch.nnodes=4", "launch.nproc_per_node=4", "launch.rdzv_endpoint=h:1",
           "parallel.cp=2", "train.global_batch_size=32"]  # fmt: skip
    groups = {k.key: k.values for k in T_space.default_space(cfg_of(recipe, *cp2),
                                                             accelerator=False)}  # fmt: skip
    assert groups["fsdp.shard_group_size"] == ("null", "4")
    assert "fsdp.shard_group_size" not in {k.key for k in T_space.default_space(
        cfg_of(recipe), accelerator=False)}  # fmt: skip
    knobs, _ = T_space.parse_space(["fsdp.sharding=full,hybrid", "fsdp.shard_group_size=null,2"],
                                   cfg, accelerator=False, allow_numerics=False)  # fmt: skip
    cands = T_space.enumerate_candidates(
        knobs, {k.key: T_space.current_value(cfg, k.key) for k in knobs}
    )
    T_space.prune(cands, str(recipe), launch, device_memory_bytes=10**10, margin=0.1,
                  dominate_memory_knobs=False)  # fmt: skip
    why = {c.label: (c.status, c.reason) for c in cands}
    assert why["fsdp.shard_group_size=2"] == (
        "pruned",
        "same as c0: fsdp.shard_group_size does nothing under fsdp.sharding=full",
    )
    assert why["shard=hybrid fsdp.shard_group_size=2"] == ("kept", None)


def test_plan_disagreements_are_flagged_either_way():
    cand = T_space.Candidate(
        1, {}, {"k": "v"}, planned_peak_bytes=100, planned_model_state_bytes=100
    )

    def rec(state, peak, kind="allocated"):
        return {"model_state_bytes": state, "peak_bytes": peak, "memory_kind": kind}

    assert T_report.plan_flags(cand, [rec(103, 108)], margin=0.1) == []
    over = T_report.plan_flags(cand, [rec(110, 120)], margin=0.1)
    assert "model state measured 1.10x" in over[0] and "peak allocated 1.20x" in over[1]
    under = T_report.plan_flags(
        cand, [rec(90, 50)], margin=0.1
    )  # a plan that overstates prunes wrongly
    assert "0.90x" in under[0] and "peak allocated 0.50x the plan" in under[1]
    assert (
        T_report.plan_flags(cand, [rec(100, 500, kind="RSS")], margin=0.1) == []
    )  # RSS holds torch


def test_prior_order_prefers_big_micro_batches_without_recompute():
    def cand(i, **knobs):
        full = {"train.micro_batch_size": "1", "activation_checkpointing.mode": "none", **knobs}
        return T_space.Candidate(i, full, {k: v for k, v in knobs.items()})

    cands = [cand(0), cand(1, **{"train.micro_batch_size": "2"}),
             cand(2, **{"activation_checkpointing.mode": "full", "train.micro_batch_size": "8"}),
             cand(3, **{"train.micro_batch_size": "4"})]  # fmt: skip
    assert [c.index for c in T_space.prior_order(cands)] == [0, 3, 1, 2]


# ---------------------------------------------------------------------------------------------
# The schedule


def test_halving_schedule_and_budget():
    rounds = T_search.halving_schedule(20, steps=4, finalists=2, repeats=3)
    assert [(r.num_candidates, r.measured_steps, r.repeats) for r in rounds] == [
        (20, 4, 1), (7, 8, 1), (3, 16, 3),
    ]  # fmt: skip
    assert T_search.halving_schedule(3, steps=2, finalists=2, repeats=2) == [
        T_trials.Round(0, 3, 2, 2)
    ]
    cost = T_search.schedule_cost_s(rounds, overhead_s=10, step_s=1)
    assert cost == 20 * 14 + 7 * 18 + 9 * 26
    assert (
        T_search.fit_to_budget(20, cost, overhead_s=10, step_s=1, steps=4, finalists=2, repeats=3)
        == 20
    )
    n = T_search.fit_to_budget(
        20, cost / 2, overhead_s=10, step_s=1, steps=4, finalists=2, repeats=3
    )
    assert 3 <= n < 20
    fits = T_search.halving_schedule(n, steps=4, finalists=2, repeats=3)
    assert T_search.schedule_cost_s(fits, overhead_s=10, step_s=1) <= cost / 2
    assert (
        T_search.fit_to_budget(20, 1, overhead_s=10, step_s=1, steps=4, finalists=2, repeats=3) == 2
    )
    # The confirmation's pairs (each trial as long as the last round's) are part of the cost,
    # so the budget that covered 20 candidates without them covers fewer with them.
    confirmed = T_search.schedule_cost_s(rounds, overhead_s=10, step_s=1, confirm=3)
    assert confirmed == cost + 3 * 2 * 26
    n = T_search.fit_to_budget(20, cost, overhead_s=10, step_s=1, steps=4, finalists=2, repeats=3,
                               confirm=3)  # fmt: skip
    assert 3 <= n < 20
    assert T_search.schedule_cost_s(
        T_search.halving_schedule(n, steps=4, finalists=2, repeats=3), overhead_s=10, step_s=1,
        confirm=3,
    ) <= cost  # fmt: skip


def test_parse_duration():
    assert T.parse_duration("20m", "--budget") == 1200
    assert T.parse_duration("90s", "--budget") == 90
    assert T.parse_duration("1.5h", "--budget") == 5400
    assert T.parse_duration("45", "--budget") == 45
    for bad in ("", "0", "-3m", "soon"):
        with pytest.raises(UserError, match="--budget"):
            T.parse_duration(bad, "--budget")


# ---------------------------------------------------------------------------------------------
# Selection


def trial(cand, rnd, rep, times, status="ok", tokens=1000, overrides=()):
    return {"id": f"r{rnd}-{cand}-{rep}", "candidate": cand, "label": cand, "round": rnd,
            "status": status, "step_times_s": times, "tokens_per_step": tokens,
            "overrides": list(overrides)}  # fmt: skip


def test_select_needs_more_than_the_noise():
    base = [trial("c0", 0, 0, [1.0, 1.1, 0.9, 1.0]), trial("c0", 1, 0, [1.0, 1.05, 0.95, 1.0])]
    fast = [trial("c1", 0, 0, [0.5, 0.55, 0.5, 0.45]), trial("c1", 1, 0, [0.5, 0.5, 0.52, 0.48])]
    close = [trial("c2", 0, 0, [0.98, 1.1, 0.9, 0.97])]
    failed = [trial("c3", 0, 0, [], status="oom")]
    sel = T_search.select(base + fast + close + failed)
    assert sel.winner == "c1" and sel.beats_noise and sel.gain == pytest.approx(1.0, rel=0.05)
    # Ranked: the finalists of round 1 first, then round 0, then the ones with no good trial.
    assert [r.candidate for r in sel.ranking] == ["c1", "c0", "c2", "c3"]
    assert sel.ranking[1].round == 1 and sel.ranking[2].round == 0 and sel.ranking[3].round is None
    # A candidate faster in the median but inside the noise does not replace the baseline.
    noisy = [trial("c1", 1, 0, [0.7, 1.3, 0.6, 1.2])]
    sel = T_search.select(base + noisy)
    assert sel.winner == "c0" and not sel.beats_noise and sel.gain > 0
    assert "within the measured noise" in sel.verdict and "stays" in sel.verdict
    # The starting recipe never ran (out of memory): the fastest candidate that ran wins.
    sel = T_search.select([trial("c0", 0, 0, [], "oom"), *close, *fast])
    assert sel.winner == "c1" and "no trial of the starting recipe succeeded" in sel.verdict
    assert T_search.select([trial("c0", 0, 0, [], "oom"), *failed]).winner == "c0"


def test_select_prefers_fewer_knobs_within_the_noise():
    """Of the challengers that beat the baseline beyond the noise, one within the noise of the
    fastest that changes fewer knobs wins, and the verdict says so; one clearly slower, or one
    that does not beat the baseline beyond the noise, does not."""

    def steps(mean):  # a spread of +-10%: the noise between two sides of 8 steps is ~19%
        return [mean * (0.9 + 0.2 * (k % 2)) for k in range(8)]

    base = trial("c0", 0, 0, steps(1.0))
    two = trial("c3", 0, 0, steps(0.49), overrides=["train.micro_batch_size=2", "fsdp.x=1"])
    one = trial("c2", 0, 0, steps(0.50), overrides=["train.micro_batch_size=2"])
    sel = T_search.select([base, two, one])
    assert sel.winner == "c2" and sel.beats_noise and sel.passed_over == "c3", sel.verdict
    assert sel.gain == pytest.approx(1.0)
    assert sel.verdict.startswith("c2 (c2) beats the starting recipe by +100.0%, more than the "
                                  "measured noise (±")  # fmt: skip
    assert "; preferred to the fastest, c3 (c3, +104.1%), as within the measured noise of it" in (
        sel.verdict
    ) and sel.verdict.endswith("changes fewer knobs from the recipe (1 against 2)")
    # The fastest stays where the one with fewer knobs is slower beyond the noise...
    slow = trial("c2", 0, 0, steps(0.75), overrides=["train.micro_batch_size=2"])
    sel = T_search.select([base, two, slow])
    assert sel.winner == "c3" and sel.passed_over is None and "preferred" not in sel.verdict
    # ...and one that changes fewer knobs but is within the noise of the baseline never wins.
    idle = trial("c1", 0, 0, steps(0.98), overrides=["fsdp.x=1"])
    assert T_search.select([base, one, idle]).winner == "c2"
    # Compared in another round (fewer measured steps) than the fastest: not a rival.
    early = [trial("c0", 1, 0, steps(1.0)),
             trial("c3", 1, 0, steps(0.49), overrides=["a=1", "b=1"])]  # fmt: skip
    sel = T_search.select([base, one, *early])
    assert sel.winner == "c3" and sel.passed_over is None


def test_select_is_a_function_of_the_log():
    import random

    rng = random.Random(0)
    records = [trial(f"c{c}", r, k, [rng.uniform(0.5, 1.5) for _ in range(4)])
               for c in range(5) for r in range(2) for k in range(2)]  # fmt: skip
    first = T_search.select(records)
    for _ in range(5):
        rng.shuffle(records)
        again = T_search.select([dict(r) for r in records])
        assert again.winner == first.winner and again.verdict == first.verdict
        assert [r.candidate for r in again.ranking] == [r.candidate for r in first.ranking]


def test_pareto_front_and_loss_check():
    assert T_search.pareto_front([("a", 1, 10), ("b", 2, 20), ("c", 2, 15), ("d", 3, 20)]) == [
        "a",
        "b",
    ]
    assert (
        T_trials.loss_problem([5.0, 4.9, 4.8, 1.0], [5.0, 4.9, 4.8 * (1 + 5e-5), 9.0], 1e-4) is None
    )
    assert "step 2" in T_trials.loss_problem([5.0, 4.8, 4.8], [5.0, 4.9, 4.8], 1e-4)
    assert "step 1" in T_trials.loss_problem([float("nan")], [5.0], 1e-4)


# ---------------------------------------------------------------------------------------------
# The trial log and the tuned layer


def test_trial_log_survives_a_torn_write_and_refuses_another_search(tmp_path):
    path = tmp_path / "trials.jsonl"
    header = {"event": "tune", "search": "abc"}
    log = T_trials.TrialLog(path, header)
    log.add({"event": "trial", "id": "r0-c0-0"})
    with path.open("a") as f:
        f.write('{"event": "trial", "id": "r0-c1')  # killed inside the write
    again = T_trials.TrialLog(path, header)
    assert [r["id"] for r in again.records] == ["r0-c0-0"]
    again.add({"event": "trial", "id": "r0-c1-0"})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d.get("id") for d in lines] == [None, "r0-c0-0", "r0-c1-0"]
    with pytest.raises(UserError, match="another search"):
        T_trials.TrialLog(path, {"event": "tune", "search": "other"})


def test_tuned_layer_sets_only_the_winning_knobs(tmp_path, recipe):
    winner = T_space.Candidate(3, {}, {"train.micro_batch_size": "4", "fsdp.forward_prefetch": "1"})
    text = T_report.tuned_layer(str(recipe.resolve()), ["optim.lr=0.001", "~train.seed"], winner,
                         config=cfg_of(recipe), verdict="c3 beats it by +50%", hardware="2 x CPU",
                         command="fsdprun train x")  # fmt: skip
    assert text.startswith("# fsdprun train x\n# Tuned by fsdprun tune on ")
    assert "2 x CPU" in text and "+50%" in text
    doc = yaml.safe_load(text)
    assert doc == {"extends": str(recipe.resolve()), "optim": {"lr": 1e-3}, "train": {"seed": 0,
                   "micro_batch_size": 4}, "fsdp": {"forward_prefetch": 1}}  # fmt: skip
    layer = tmp_path / "sub" / "tuned.yaml"
    layer.parent.mkdir()
    layer.write_text(text)
    cfg = load_recipe(str(layer)).config
    assert cfg.train.micro_batch_size == 4 and cfg.train.global_batch_size == 16
    assert cfg.optim.lr == 1e-3 and cfg.fsdp.forward_prefetch == 1
    builtin = yaml.safe_load(T_report.tuned_layer("debug", [], winner, config=cfg, verdict="v",
                                           hardware="h", command="c"))  # fmt: skip
    assert builtin["extends"] == "debug"


# ---------------------------------------------------------------------------------------------
# Real searches


def tune_cmd(recipe: Path, out: Path, *args: str) -> list[str]:
    return ["tune", str(recipe), "--out", str(out), "--nproc-per-node", "2", *args]


def trials_of(out: Path) -> list[dict]:
    lines = (out / "trials.jsonl").read_text().splitlines()
    return [d for d in map(json.loads, lines) if d["event"] == "trial"]


def test_tune_moves_to_a_larger_micro_batch_that_fits(tmp_path, recipe):
    # 1 x 8 accumulation against 4 x 2: a quarter of the micro-steps (and their collectives),
    # a margin that survives a loaded machine; mb=8 plans over the device memory.
    # A learning-rate warm-up longer than a trial (llama-1b's 10 steps against 3 + 2 on the
    # H200: every trial was refused): the trials run it cut to their length.
    # Then the confirmation's 2 pairs of real trials: the gain measured after the search.
    out = tmp_path / "out"
    proc = run_fsdprun(
        *tune_cmd(recipe, out, "schedule.warmup_steps=24", "--space",
                  "train.micro_batch_size=1,4,8", "--device-memory", "6MiB", "--steps", "16",
                  "--repeats", "2", "--confirm", "2", "--budget", "10m", "--json", "--plot",
                  str(tmp_path / "tune.png")),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {r["label"]: r for r in report["candidates"]}
    # mb=8 plans over the device memory and is pruned before any launch.
    assert rows["mb=8"]["status"] == "pruned" and "device memory" in rows["mb=8"]["reason"]
    assert not (out / "trials" / "r0-c2-0").exists()
    assert report["beats_noise"], report["verdict"]
    assert report["winner_label"] == "mb=4", report["verdict"]
    winner = rows["mb=4"]
    # The winner fits: measured model state per rank, and its plan with the margin.
    assert winner["model_state_bytes"] <= report["device_memory_bytes"]
    assert winner["planned_peak_bytes"] * 1.1 <= report["device_memory_bytes"]
    assert not winner["plan_flags"]  # measured model state within 5% of the plan
    # Two candidates: the first round is the last, repeated and interleaved.
    records = trials_of(out)
    assert [r["id"] for r in records] == ["r0-c0-0", "r0-c1-0", "r0-c0-1", "r0-c1-1"]
    assert all(r["status"] == "ok" and r.get("loss_checked", True) for r in records)
    assert all(len(r["step_times_s"]) == r["measured_steps"] == 16 for r in records)
    # The confirmation: 2 pairs after the search, as long as its trials, the order alternating;
    # its ratio is the median of the pairs' (winner / baseline median tokens/s), each side read
    # here from its trial's own metrics.jsonl.
    confirm = [d for d in map(json.loads, (out / "trials.jsonl").open()) if d["event"] == "confirm"]
    assert [r["id"] for r in confirm] == ["confirm-c0-0", "confirm-c1-0", "confirm-c1-1",
                                          "confirm-c0-1"]  # fmt: skip
    assert all(r["status"] == "ok" and r["measured_steps"] == 16 for r in confirm), confirm
    assert confirm[1]["loss_checked"] and confirm[2]["loss_checked"]

    def tokens_per_s(tid: str) -> float:
        events = [json.loads(x) for x in (out / "trials" / tid / "metrics.jsonl").open()]
        start, summary = next(e for e in events if e["event"] == "start"), events[-1]
        times = summary["step_times_s"][summary["timing_warmup_steps"] :]
        return statistics.median(start["tokens_per_step"] / t for t in times)

    pairs = [tokens_per_s(f"confirm-c1-{k}") / tokens_per_s(f"confirm-c0-{k}") for k in (0, 1)]
    conf = report["confirmation"]
    assert [p["ratio"] for p in conf["pairs"]] == pytest.approx(pairs)
    assert report["measured_ratio"] == pytest.approx(statistics.median(pairs))
    assert report["measured_ratio"] > 1 and conf["holds"], conf["line"]
    assert conf["predicted"] == pytest.approx(1 + report["gain"])
    header = (out / "tuned.yaml").read_text().splitlines()[3]
    assert header == f"# C{conf['line'][1:]}." and header.startswith("# Confirmed: c1 (mb=4) ")
    console = Console(record=True, width=400)
    T_report.render(report, console)
    assert conf["line"] in console.export_text().splitlines()
    # tuned.yaml: only allowed knobs, and it trains with the original's fp32 losses.
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert tuned.pop("extends") == str(recipe.resolve())
    assert tuned.pop("schedule") == {"warmup_steps": 24}  # the user's, not the trials' cut
    keys = {f"{s}.{k}" for s, d in tuned.items() for k in d}
    assert keys == {"train.micro_batch_size"} <= set(T_space.MATH_KNOBS)
    assert report["command"] == f"fsdprun train {out / 'tuned.yaml'} --nproc-per-node 2"
    base = next(r for r in records if r["id"] == "r0-c0-0")
    steps = len(base["losses"])
    run = run_fsdprun("train", str(out / "tuned.yaml"), f"train.steps={steps}",
                      f"schedule.warmup_steps={steps}", "checkpoint.save_final=false",
                      "output.log_every=1", "--nproc-per-node", "2", "--run-dir",
                      str(tmp_path / "check"), cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "check/metrics.jsonl").open()]
    start = next(e for e in events if e["event"] == "start")
    assert start["micro_batch_size"] > 1 and start["global_batch_size"] == 16
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert losses == pytest.approx(base["losses"], abs=1e-5)
    assert (tmp_path / "tune.png").stat().st_size > 10_000


def test_tuned_yaml_of_relative_paths_trains_from_another_directory(tmp_path):
    """`fsdprun tune sft-demo model.hf_path=myhf data.tokenizer=models/tiny` in a work folder:
    tuned.yaml holds those folders' absolute paths (in it, `myhf` would be read from its own
    folder, and `models/tiny`, found nowhere, as a Hub id), so the printed train command runs
    from anywhere. One trial: mb=1 plans over the device memory, and so does the starting
    recipe, which runs with a warning."""
    tiny = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    shutil.copytree(tiny, work / "myhf")
    shutil.copytree(tiny, work / "models" / "tiny")
    elsewhere.mkdir()
    proc = run_fsdprun(
        "tune", "sft-demo", "model.hf_path=myhf", "data.tokenizer=models/tiny", "--out", "t",
        "--nproc-per-node", "2", "--device-memory", "1MB", "--space",
        "train.micro_batch_size=1", "--steps", "1", "--repeats", "1", "--budget", "5m", cwd=work,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The starting recipe's own plan is over the device memory: said before its trial runs.
    warning = next(x for x in proc.stderr.splitlines() if x.startswith("warning: "))
    assert warning.startswith("warning: the starting recipe plans a peak of ") and warning.endswith(
        " per rank, over the device memory 976.56 KiB (--device-memory) with the 10% margin; its "
        "trials (the baseline, run first) may run out of memory"), warning  # fmt: skip
    assert proc.stderr.index(warning) < proc.stderr.index("r0-c0-0 baseline")
    [record] = trials_of(work / "t")
    assert record["status"] == "ok", record
    tuned = yaml.safe_load((work / "t" / "tuned.yaml").read_text())
    assert tuned["model"]["hf_path"] == str(work / "myhf")
    assert tuned["data"]["tokenizer"] == str(work / "models" / "tiny")
    ran = yaml.safe_load((work / record["run_dir"] / "recipe.yaml").read_text())
    assert (ran["model"]["hf_path"], ran["data"]["tokenizer"]) == (
        str(work / "myhf"), str(work / "models" / "tiny"))  # fmt: skip
    proc = run_fsdprun("train", str(work / "t" / "tuned.yaml"), "train.steps=1",
                       "checkpoint.save_final=false", "eval.every_steps=0", "--nproc-per-node",
                       "2", "--run-dir", "run", cwd=elsewhere)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (elsewhere / "run" / "metrics.jsonl").is_file()


def _trials_left(out: Path, within_s: float = 5) -> list[int]:
    """The processes still naming the search's trial directories after `within_s` (a trial's
    launcher and workers get SIGKILL as tune dies; reaping them takes a moment)."""
    deadline = time.monotonic() + within_s
    while (pids := processes_naming(str(out / "trials"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def _signals(pid: int) -> dict[str, str]:
    """A process's signal masks, from /proc (SigBlk, SigIgn, SigCgt: hexadecimal)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t") for line in lines if line.startswith("Sig"))


def test_tune_survives_failure_hang_budget_and_kill(tmp_path, recipe):
    out = tmp_path / "out"
    args = tune_cmd(recipe, out, "--space", "train.micro_batch_size=1,2", "--device-memory",
                    "1GB", "--steps", "2", "--repeats", "2")  # fmt: skip
    # A budget that the first trial spends: one trial, then it stops, past the budget by less
    # than that trial's length (plus the planning before it).
    proc = run_fsdprun(*args, "--budget", "1s", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    first = trials_of(out)
    assert [r["id"] for r in first] == ["r0-c0-0"]
    assert "--budget 1 s spent" in report["stopped_early"]
    assert report["elapsed_s"] <= 1 + first[0]["wall_s"] + 15
    assert report["winner"] == "c0"

    # Continue with a failing trial, and kill -9 tune in the trial after it.
    env = fsdprun_env(FSDPRUN_TUNE_FAULT="r0-c1-0:FSDPRUN_FAIL_AT=0:2")
    popen = start_fsdprun(*args, "--budget", "10m", cwd=tmp_path, env=env)
    deadline = time.monotonic() + 120
    running = out / "trials" / "r0-c0-1"  # made by the trial's own `fsdprun train`
    while not running.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running.exists(), "the trial after the failing one never started"
    popen.send_signal(signal.SIGKILL)
    popen.wait()
    killed = trials_of(out)
    assert [r["id"] for r in killed] == ["r0-c0-0", "r0-c1-0"]
    assert killed[0] == first[0]
    assert killed[1]["status"] == "failed" and "FSDPRUN_FAIL_AT" in killed[1]["reason"]
    assert not _trials_left(out), "a trial outlived its tune"
    status = run_fsdprun("status", str(out), cwd=tmp_path).stdout.splitlines()
    assert status[0] == (f"{out}: tune of mb1 not running; its last session ended before the "
                         "search did (Ctrl-C, a kill, an error or a spent --budget): rerun the "
                         "same command to continue")  # fmt: skip

    # Ctrl-C in the same trial, run again, then SIGTERM: exit 130 and 143 with one line that
    # says what is kept and how to continue, the trial goes with tune, the log as it was.
    # The trial hangs at its first step, so it is still running when the signal comes (a trial
    # that finished first made tune end well before it, on a loaded machine).
    # tune starts as a terminal's foreground command does, SIGINT neither ignored nor blocked
    # (start_fsdprun's command, as a fresh Python, raises KeyboardInterrupt on it).
    for signum in (signal.SIGINT, signal.SIGTERM):
        began = time.time()
        hang = fsdprun_env(FSDPRUN_TUNE_FAULT="r0-c0-1:FSDPRUN_HANG_AT=0:1")
        popen = start_fsdprun(*args, "--budget", "10m", cwd=tmp_path, env=hang)
        trial_log = out / "logs" / "r0-c0-1.log"
        # The killed tune's r0-c0-1 directory is removed before the log is opened for the new
        # trial, so a directory after that is the new trial's `fsdprun train` running.
        while time.monotonic() < deadline + 240 and not (
            trial_log.exists() and trial_log.stat().st_mtime > began and running.exists()
        ):  # fmt: skip
            time.sleep(0.1)
        assert running.exists(), "the interrupted trial never started again"
        if signum == signal.SIGINT:
            # `fsdprun status` on --out while the search runs: the trials done, the best so
            # far, the budget left, the last trial.
            status = run_fsdprun("status", str(out), cwd=tmp_path).stdout.splitlines()
            assert status[0].startswith(f"{out}: tune of mb1 running, pid {popen.pid} on ")
            assert status[1].startswith(
                "2 trials done (1 failed, 1 ok); best so far c0 (baseline): "
            ) and status[1].endswith(" tokens/s")
            assert re.fullmatch(r"budget 10m00s: \d+m\d\ds left", status[2]), status
            assert status[3].startswith("last trial r0-c1-0 mb=2: failed (exit 1: ") and (
                "FSDPRUN_FAIL_AT" in status[3])  # fmt: skip
            handled = _signals(popen.pid)
            assert int(handled["SigCgt"], 16) & (1 << (signal.SIGINT - 1)), handled
            assert not int(handled["SigBlk"], 16) & (1 << (signal.SIGINT - 1)), handled
        popen.send_signal(signum)
        _, err = popen.communicate(timeout=60)
        assert popen.returncode == 128 + signum and "Traceback" not in err, err[-2000:]
        assert err.strip().splitlines()[-1] == (
            f"tune interrupted by {signum.name}: 2 finished trial(s) are kept in "
            f"{out / 'trials.jsonl'} (a trial in progress is stopped and not logged); rerun the "
            "same command to continue")  # fmt: skip
        assert trials_of(out) == killed
        assert not _trials_left(out), "a trial outlived its tune"

    # Again: the interrupted trial runs again, the finished ones do not; one that hangs is killed
    # at its timeout, recorded, and the search still ends with a report. The timeout: three times
    # what the same candidate's first trial took here (r0-c0-1 must still finish in it), at
    # least 12 s, so the hung trial costs the suite what a trial is given and no more.
    timeout_s = min(45, max(12, round(3 * first[0]["wall_s"])))
    env = fsdprun_env(FSDPRUN_TUNE_FAULT="r0-c1-1:FSDPRUN_HANG_AT=0:2")
    proc = run_fsdprun(*args, "--budget", "10m", "--trial-timeout", str(timeout_s), cwd=tmp_path,
                       env=env, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "continuing" in proc.stderr and "2 finished trials" in proc.stderr
    final = trials_of(out)
    ids = [r["id"] for r in final]
    assert ids == ["r0-c0-0", "r0-c1-0", "r0-c0-1", "r0-c1-1"]
    assert final[:2] == killed
    assert final[2]["status"] == "ok"
    assert final[3]["status"] == "timeout" and final[3]["reason"].startswith("hung")
    assert timeout_s <= final[3]["wall_s"] < timeout_s + 15
    assert "c0" in proc.stdout and "hung" in proc.stdout
    status = run_fsdprun("status", str(out), cwd=tmp_path).stdout.splitlines()
    assert status[0].startswith(f"{out}: tune of mb1 finished: ") and status[0].endswith(
        f"; wrote {out / 'tuned.yaml'}"), status  # fmt: skip
    assert status[1].startswith("4 trials done (1 failed, 2 ok, 1 timeout); best so far c")
    assert yaml.safe_load((out / "tuned.yaml").read_text()) == {"extends": str(recipe.resolve())}


def test_tune_refuses_cpu_without_device_memory(tmp_path, recipe):
    proc = run_fsdprun(*tune_cmd(recipe, tmp_path / "o", "--budget", "1m"), cwd=tmp_path)
    assert proc.returncode == 2 and "--device-memory is required on CPU" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()
    proc = run_fsdprun(*tune_cmd(recipe, tmp_path / "o", "--budget", "soon"), cwd=tmp_path)
    assert proc.returncode == 2 and "--budget 'soon'" in proc.stderr
    proc = run_fsdprun(*tune_cmd(recipe, tmp_path / "o", "--device-memory", "1GB", "--space",
                                 "train.seq_len=32,64"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "train.seq_len: not a tuning knob" in proc.stderr
    # A value no recipe takes is refused at once, as a value of the wrong type is; one that
    # only this recipe refuses (3 does not divide the batch) is a candidate, pruned by the plan.
    for space, refused in (("train.micro_batch_size=0,3", "'0' must be > 0"),
                           ("fsdp.forward_prefetch=1,-1", "'-1' must be >= 0"),
                           ("fsdp.engine=fsdp3", "'fsdp3' is not a valid")):  # fmt: skip
        proc = run_fsdprun(*tune_cmd(recipe, tmp_path / "o", "--device-memory", "1GB", "--space",
                                     space), cwd=tmp_path)  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and refused in lines[0], proc.stderr
    if launch_device_problem(DeviceKind.accelerator):  # a CPU machine, as in CI
        # A recipe for accelerators: every trial would be refused the same way, so tune is.
        proc = run_fsdprun(*tune_cmd(recipe, tmp_path / "o", "--device-memory", "1GB",
                                     "launch.device=accelerator"), cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 2 and "launch.device=cpu forces" in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == [recipe.name]


def test_tune_dry_run_prints_the_space_pruning_and_order(tmp_path, recipe):
    args = tune_cmd(
        recipe,
        tmp_path / "o",
        "--device-memory",
        "6MiB",
        "--dry-run",
        "--space",
        "train.micro_batch_size=1,2,4,8",
        "--space",
        "fsdp.limit_all_gathers=true,false",
    )
    proc = run_fsdprun(*args, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stderr
    pruned = "pruned 5, by reason (--json lists each candidate):"
    assert text.index("space (8 candidates)") < text.index(pruned) < text.index("order (3)")
    # One line per reason (the default space prunes hundreds), the most common first, each with
    # its count and one candidate.
    lines = text[text.index(pruned) + len(pruned) : text.index("order (3)")].splitlines()[1:]
    assert len(lines) == 2, lines
    assert lines[0] == (
        "  4 x fsdp.limit_all_gathers does nothing under fsdp2 (knob table); e.g. c1 "
        "limit_ag=false: same as c0: fsdp.limit_all_gathers does nothing under fsdp2 (knob table)"
    )
    assert lines[1].startswith(
        "  1 x planned peak + 10% margin > device memory; e.g. c6 mb=8: planned peak "
    ) and lines[1].endswith("> device memory 6.00 MiB")
    doc = json.loads(run_fsdprun(*args, "--json", cwd=tmp_path).stdout)
    assert doc["order"] == ["c0", "c4", "c2"]
    why = {c["candidate"]: c["reason"] for c in doc["candidates"] if c["status"] == "pruned"}
    assert sorted(why) == ["c1", "c3", "c5", "c6", "c7"]
    assert why["c7"] == "same as c6: fsdp.limit_all_gathers does nothing under fsdp2 (knob table)"
    assert [(r["num_candidates"], r["repeats"]) for r in doc["rounds"]] == [(3, 2)]
    assert not (tmp_path / "o").exists()


def test_the_default_space_under_tensor_parallel_leaves_out_what_tp_refuses(tmp_path, recipe):
    """fsdp1 and the chunked loss, which parallel.tp always refuses, are not in the default
    space (before, 376 of 384 candidates were pruned for them and CPU offload, which TP now
    takes); the micro-batch sizes are those of the data-parallel ranks' share (a TP group shares
    its micro-batch)."""
    proc = run_fsdprun(*tune_cmd(recipe, tmp_path / "o", "parallel.tp=2", "--device-memory",
                                 "1GB", "--dry-run", "--json"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    space = {k["key"]: k["values"] for k in doc["space"]}
    assert space["fsdp.engine"] == ["fsdp2"] and space["train.loss"] == ["plain"]
    assert space["fsdp.cpu_offload"] == ["false", "true"]
    assert space["train.micro_batch_size"] == ["1", "2", "4", "8", "16"]  # 16 / 1 dp rank
    assert space["activation_checkpointing.mode"] == ["none", "selective", "full"]
    assert sorted(doc["left_out"]) == ["fsdp.engine=fsdp1", "train.loss=chunked"]
    assert all("parallel.tp=2 with" in why for why in doc["left_out"].values())
    assert not [c for c in doc["candidates"] if "refuse" in (c["reason"] or "")]


def test_search_schedule_budget_and_resume_with_a_fake_clock(tmp_path, monkeypatch):
    # The scheduler alone: trials replaced by records whose speed is a function of the
    # candidate, time by a clock each trial advances by its wall time.
    clock = [0.0]
    ran: list[str] = []

    def fake_trial(recipe, overrides, cand, *, tid, round_, warmup, out_dir, timeout_s):
        ran.append(tid)
        step_s = 1.0 / (1 + cand.index)  # c5 is the fastest
        clock[0] += 10 + round_.measured_steps * step_s
        times = [step_s * (1 + 0.01 * k) for k in range(round_.measured_steps)]
        return {"event": "trial", "id": tid, "candidate": cand.id, "label": cand.label,
                "round": round_.index, "status": "ok", "wall_s": 10 + sum(times),
                "step_times_s": times, "tokens_per_step": 100,
                "losses": [5.0, 4.9, 4.8], "peak_bytes": 2**20, "model_state_bytes": 2**10,
                "memory_kind": "RSS", "mfu": None, "time_to_first_step_s": 3.0}  # fmt: skip

    monkeypatch.setattr(T_search, "run_trial", fake_trial)
    monkeypatch.setattr(T_search.time, "perf_counter", lambda: clock[0])
    cands = [T_space.Candidate(i, {"k": str(i)}, {"k": str(i)} if i else {}) for i in range(6)]

    def search(budget_s: float, out: Path, confirm: int = 0):
        out.mkdir(exist_ok=True)
        args = T.TuneArgs(recipe="r", overrides=[], launch_overrides=[], launch_flags=[],
                          out_dir=out, budget_s=budget_s, steps=2, repeats=2, finalists=1,
                          confirm=confirm)  # fmt: skip
        log = T_trials.TrialLog(out / "trials.jsonl", {"event": "tune", "search": "s"})
        start = clock[0]
        stop, left = T_search.run_search(
            args, log, cands, warmup=1, rtol=1e-4, started=start, say=print
        )
        return stop, left, log, clock[0] - start

    # Enough budget: 6 candidates x 2 steps, the best 2 (baseline + c5) for 4 steps x 2.
    stop, left, log, spent = search(1e4, tmp_path / "a")
    assert stop is None and left == {}
    assert ran == [f"r0-c{i}-0" for i in range(6)] + ["r1-c0-0", "r1-c5-0", "r1-c0-1", "r1-c5-1"]
    assert T_search.select(log.records).winner == "c5"
    resolved = load_recipe("debug")
    args = T.TuneArgs(recipe="debug", overrides=[], launch_overrides=[], launch_flags=[],
                      out_dir=tmp_path / "a", budget_s=1e4, confirm=0)  # fmt: skip
    report = T_report.tune_report(args, resolved, resolved.config, cands, log.records, 10**9,
                                  "given", None, 0.0, 1e-4)  # fmt: skip
    reasons = {r["candidate"]: r["reason"] for r in report["candidates"]}
    assert report["winner"] == "c5" and reasons["c5"] is None and reasons["c0"] is None
    assert {reasons[f"c{i}"] for i in range(1, 5)} == {"dropped after round 0 (successive halving)"}
    # A budget for 3 candidates' schedule (3 x 12 s, then 2 x 2 x 14 s): the first round is cut
    # after the first trial, within the budget plus one trial.
    ran.clear()
    stop, left, log, spent = search(95, tmp_path / "b")
    assert set(left) == {"c3", "c4", "c5"} and "covers the schedule of 3" in left["c3"]
    assert ran == ["r0-c0-0", "r0-c1-0", "r0-c2-0", "r1-c0-0", "r1-c2-0", "r1-c0-1", "r1-c2-1"]
    assert stop is None and spent <= 95
    # The same budget with 2 confirmation pairs to come (4 trials of 14 s): the schedule it
    # covers is 2 candidates'; 95 + 56 s covers the 3 again.
    ran.clear()
    stop, left, log, spent = search(95, tmp_path / "b3", confirm=2)
    assert ran == ["r0-c0-0", "r0-c1-0", "r0-c0-1", "r0-c1-1"] and len(left) == 4
    ran.clear()
    stop, left, log, spent = search(95 + 56, tmp_path / "b4", confirm=2)
    assert set(left) == {"c3", "c4", "c5"} and spent <= 95
    # Cut to 2: the first round becomes the last one, with its repeats.
    ran.clear()
    stop, left, log, spent = search(60, tmp_path / "b2")
    assert ran == ["r0-c0-0", "r0-c1-0", "r0-c0-1", "r0-c1-1"] and len(left) == 4
    assert spent <= 60
    # A budget spent mid-search stops before the next trial; the rerun repeats nothing.
    ran.clear()
    stop, _, log, spent = search(35, tmp_path / "c")
    assert stop and "spent" in stop and spent <= 35 + 12
    done = list(ran)
    ran.clear()
    stop, _, log, _ = search(1e4, tmp_path / "c")
    assert stop is None and not set(ran) & set(done)
    assert len({r["id"] for r in log.records}) == len(log.records)


def test_tune_prefers_fewer_knobs_and_reports_the_gain_it_confirms(tmp_path, recipe, monkeypatch):
    """`fsdprun tune` as typed, its trials' `fsdprun train` replaced by records of a designed
    speed (the real trials: test_tune_moves_to_a_larger_micro_batch_that_fits), on a clock each
    trial advances by its length. mb=2 halves the step time and fwd_prefetch=1 takes 2% off it,
    every step +-10%: `mb=2 fwd_prefetch=1` is the fastest, `mb=2` within the noise of it with
    one knob fewer wins, and the verdict says so. Then the confirmation: the winner and the
    starting recipe in interleaved pairs (B W W B B W) while the machine slows 10% a trial; the
    measured ratio is the median of the pairs', beside the search's 2.00x, in the report and in
    tuned.yaml's header. A rerun runs nothing again. A winner the confirmation measures no
    faster, or whose confirmation trial fails, is not kept; a spent budget cuts the pairs."""
    import types

    from typer.testing import CliRunner

    from fsdprun.cli import app

    clock, ran, drill = [0.0], [], {}

    def fake_trial(recipe_, overrides, cand, *, tid, round_, warmup, out_dir, timeout_s):
        n = sum(t.startswith("confirm-") for t in ran)  # confirmation trials before this one
        ran.append(tid)
        mb2 = cand.knobs["train.micro_batch_size"] == "2"
        step_s = (0.5 if mb2 else 1.0) * (0.98 if cand.knobs["fsdp.forward_prefetch"] == "1" else 1)
        rec = {"event": "trial", "id": tid, "candidate": cand.id, "label": cand.label,
               "overrides": cand.overrides, "round": round_.index,
               "measured_steps": round_.measured_steps, "warmup_steps": warmup}  # fmt: skip
        if tid.startswith("confirm-"):
            step_s *= 1 + 0.1 * n
            if mb2 and drill.get("winner") == "as slow":
                step_s *= 2.04  # the search's gain was luck: slower than the baseline
            if tid == drill.get("fail"):
                clock[0] += 2.0
                return dict(rec, status="failed", reason="exit 1: drill", wall_s=2.0)
        times = [step_s * (0.9 + 0.2 * (k % 2)) for k in range(round_.measured_steps)]
        clock[0] += 3 + sum(times)
        return dict(rec, status="ok", wall_s=3 + sum(times), step_times_s=times,
                    tokens_per_step=1000, losses=[5.0, 4.9, 4.8], peak_bytes=2**20,
                    model_state_bytes=2**10, memory_kind="RSS", mfu=None,
                    time_to_first_step_s=1.0)  # fmt: skip

    monkeypatch.setattr(T_search, "run_trial", fake_trial)
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time)
    for module in (T, T_search, T_report):
        monkeypatch.setattr(module, "time", fake_time)
    monkeypatch.delenv("RANK", raising=False)

    def tune(out: Path, *extra: str):
        ran.clear()
        result = CliRunner().invoke(app, [
            "tune", str(recipe), "--out", str(out), "--nproc-per-node", "2", "--device-memory",
            "1GB", "--space", "train.micro_batch_size=1,2", "--space",
            "fsdp.forward_prefetch=0,1", "--steps", "8", "--repeats", "1", "--finalists", "3",
            *extra,
        ], env={"COLUMNS": "200"})  # fmt: skip
        assert result.exit_code == 0, result.output
        return result

    out = tmp_path / "o"
    report = json.loads(tune(out, "--budget", "10m", "--json").stdout)
    ids = {r["label"]: r["candidate"] for r in report["candidates"]}
    one, two = ids["mb=2"], ids["mb=2 fwd_prefetch=1"]
    assert report["winner_label"] == "mb=2" and report["passed_over"] == two, report["verdict"]
    assert report["verdict"].startswith(f"{one} (mb=2) beats the starting recipe by +100.0%")
    assert report["verdict"].endswith(
        f"; preferred to the fastest, {two} (mb=2 fwd_prefetch=1, +104.1%), as within the "
        "measured noise of it (±18.4%) it changes fewer knobs from the recipe (1 against 2)"
    )  # fmt: skip
    # The confirmation: after the search's 4 trials, 3 pairs, their order alternating.
    assert ran[4:] == [f"confirm-{c}-{k}" for k, pair in enumerate(["c0 w", "w c0", "c0 w"])
                       for c in pair.replace("w", one).split()]  # fmt: skip
    slow = [1 + 0.1 * n for n in range(6)]  # each confirmation trial's slowing, in order
    # Each pair: baseline step time / winner step time (their spreads alike, so it cancels).
    pairs = [slow[0] / (0.5 * slow[1]), slow[3] / (0.5 * slow[2]), slow[4] / (0.5 * slow[5])]
    conf = report["confirmation"]
    assert [p["ratio"] for p in conf["pairs"]] == pytest.approx(pairs)
    assert report["measured_ratio"] == pytest.approx(sorted(pairs)[1])
    assert (conf["low"], conf["high"]) == pytest.approx((min(pairs), max(pairs)))
    assert conf["predicted"] == pytest.approx(2.0) and conf["holds"]
    line = (
        f"confirmed: {one} (mb=2) measured 1.87x the starting recipe's tokens/s after the "
        "search (median of 3 interleaved pairs, 1.82x to 2.17x); the search's figure 2.00x"
    )
    assert conf["line"] == line
    tuned = (out / "tuned.yaml").read_text()
    assert f"\n# {line[0].upper()}{line[1:]}.\n" in tuned
    assert yaml.safe_load(tuned)["train"] == {"micro_batch_size": 2}
    assert sum(d["event"] == "confirm" for d in map(json.loads, (out / "trials.jsonl").open())) == 6
    # Again: every trial is in the log, none runs; the table says the same.
    text = tune(out, "--budget", "10m").stdout
    assert ran == [] and line in text and "preferred to the fastest" in text
    assert "4 trials and 6 confirming" in text

    # The winner measured slower than the starting recipe after the search: it stays.
    drill["winner"] = "as slow"
    report = json.loads(tune(tmp_path / "slower", "--budget", "10m", "--json").stdout)
    assert report["winner"] == "c0" and report["gain"] == 0 and report["measured_ratio"] < 1
    assert report["verdict"] == (
        f"{one} (mb=2) beat the starting recipe by +100.0% in the search, but measured "
        f"{report['measured_ratio']:.2f}x it after the search (median of 3 interleaved pairs): "
        "the starting recipe stays")  # fmt: skip
    assert yaml.safe_load((tmp_path / "slower" / "tuned.yaml").read_text()) == {
        "extends": str(recipe.resolve())}  # fmt: skip
    # A confirmation trial of the winner fails: it stays too, and no further pair runs.
    drill.clear()
    drill["fail"] = f"confirm-{one}-1"
    report = json.loads(tune(tmp_path / "fails", "--budget", "10m", "--json").stdout)
    assert ran[4:] == ["confirm-c0-0", f"confirm-{one}-0", f"confirm-{one}-1"]
    assert report["winner"] == "c0" and report["verdict"].endswith(
        f"but its confirmation trial confirm-{one}-1 (failed: exit 1: drill) did not end well: "
        "the starting recipe stays")  # fmt: skip
    # A budget that covers the search and one pair: the winner stays, on one pair's figure.
    drill.clear()
    report = json.loads(tune(tmp_path / "budget", "--budget", "60s", "--json").stdout)
    conf = report["confirmation"]
    assert ran[4:] == ["confirm-c0-0", f"confirm-{one}-0"] and report["winner"] == one
    assert conf["ratio"] == pytest.approx(pairs[0]) and conf["line"].endswith(
        "; 1 of 3 pairs (--budget 60 s spent after 54 s: pairs 2 to 3 not run)")  # fmt: skip
    # The starting recipe wins, or --confirm 0: nothing to confirm, and the report says why.
    report = json.loads(tune(tmp_path / "none", "--budget", "10m", "--confirm", "0",
                             "--json").stdout)  # fmt: skip
    assert len(ran) == 4 and report["confirmation"] == {
        "skipped": "--confirm 0", "line": "no confirmation: --confirm 0"}  # fmt: skip
    result = CliRunner().invoke(app, ["tune", str(recipe), "--out", str(tmp_path / "x"),
                                      "--device-memory", "1GB", "--confirm", "-1"])  # fmt: skip
    assert result.exit_code == 2 and "--confirm must be >= 0" in result.output


def test_tune_command_hands_the_train_launch_flags_to_tune(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from fsdprun.cli import app

    seen = {}

    def fake_tune(args, *, say=None):
        seen["args"] = args
        return {"dry": True}

    monkeypatch.setattr(T, "tune", fake_tune)
    monkeypatch.delenv("RANK", raising=False)
    result = CliRunner().invoke(app, [
        "tune", "debug", "optim.lr=0.001", "--out", str(tmp_path / "o"), "--budget", "90s",
        "--nproc_per_node", "2", "--standalone", "--device-memory", "8GB", "--space",
        "train.micro_batch_size=1,2", "--space", "defaults", "--dry-run",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    args = seen["args"]
    assert args.recipe == "debug" and args.overrides == ["optim.lr=0.001"]
    assert args.launch_overrides == ["launch.nproc_per_node=2", "launch.nnodes=1",
                                     "launch.node_rank=0", "launch.rdzv_endpoint="]  # fmt: skip
    assert args.launch_flags == ["--nproc-per-node 2", "--standalone"]
    assert args.budget_s == 90 and args.device_memory_bytes == 8 * 10**9 and args.dry_run
    assert args.space == ["train.micro_batch_size=1,2", "defaults"]
    help_ = CliRunner().invoke(app, ["tune", "--help"], env={"COLUMNS": "200"})
    for flag in ("--budget", "--device-memory", "--space", "--allow-numerics", "--nproc-per-node",
                 "--rdzv-endpoint", "--trial-timeout", "--json", "--plot"):  # fmt: skip
        assert flag in help_.stdout


def test_the_noise_shrinks_with_more_measured_steps():
    # The same step-to-step spread (steps of 0.8 and 1.2 s) and a 25% gain: not shown by 4 steps
    # a side, shown by 64 (the standard error of a median falls as 1/sqrt(steps); the spread of
    # the steps, an interquartile range, would not).
    def steps(mean, n):
        return [mean * (0.8 + 0.4 * (k % 2)) for k in range(n)]

    for n, wins in ((4, False), (64, True)):
        sel = T_search.select(
            [trial("c0", 0, 0, steps(1.0, n)), trial("c1", 0, 0, steps(1 / 1.25, n))]
        )
        assert sel.gain == pytest.approx(0.25, abs=0.01)
        assert (sel.winner == "c1") is wins, (n, sel.verdict)


# ---------------------------------------------------------------------------------------------
# Several nodes


def test_merge_takes_rank0s_figures_from_any_node_and_names_a_failing_node():
    here = {"status": "ok", "wall_s": 5.0, "losses": [], "world_size": None}
    there = {"status": "ok", "wall_s": 6.0, "losses": [5.0], "step_times_s": [0.1],
             "tokens_per_step": 64, "world_size": 2, "node_rank": 1}  # fmt: skip
    merged = T_nodes.merge_records([here, there])
    assert merged["status"] == "ok" and merged["step_times_s"] == [0.1] and merged["wall_s"] == 6
    assert "node_rank" not in merged
    hung = {"status": "timeout", "wall_s": 9.0, "reason": "hung: no result within 9 s"}
    lost = {"status": "failed", "wall_s": 9.0, "reason": "exit 1: peer closed"}
    merged = T_nodes.merge_records([lost, hung])
    assert merged["status"] == "timeout" and merged["reason"].startswith("node 1: hung")
    assert "step_times_s" not in merged
    nowhere = T_nodes.merge_records([here, dict(here)])
    assert nowhere["status"] == "failed" and "metrics" in nowhere["reason"]


def test_nodes_protocol_follower_runs_node0s_trials_and_refuses_other_arguments():
    """In one process, over a real TCPStore: node 0 publishes two trials, the follower runs
    each (and here holds global rank 0's figures), node 0 merges them, the stop carries the
    report; a follower with other arguments is refused; a node 0 that goes away stops it."""
    import threading

    from conftest import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    leader = T_nodes.Leader(endpoint, nnodes=2, search="key", timeout_s=20)
    with pytest.raises(UserError, match="other arguments"):
        T_nodes.follow(endpoint, node_rank=1, search="other", timeout_s=20,
                       run_here=None, say=print)  # fmt: skip
    seen, result = [], {}

    def run_there(trial, alive):
        seen.append((trial["tid"], trial["overrides"], trial["endpoint"]))
        assert alive()
        return {"status": "ok", "wall_s": 1.0, "step_times_s": [0.5], "losses": [4.0]}

    def follower():
        result["report"] = T_nodes.follow(endpoint, node_rank=1, search="key", timeout_s=20,
                                          run_here=run_there, say=print)  # fmt: skip

    thread = threading.Thread(target=follower)
    thread.start()
    leader.wait_for_nodes(print)
    merged = [leader.run({"tid": f"r0-c{i}-0", "overrides": [f"train.micro_batch_size={i + 1}"]},
                         lambda t: {"status": "ok", "wall_s": 2.0, "losses": []})
              for i in range(2)]  # fmt: skip
    leader.finish({"report": {"winner": "c1"}})
    thread.join(timeout=20)
    assert result["report"] == {"winner": "c1"}
    assert [s[:2] for s in seen] == [("r0-c0-0", ["train.micro_batch_size=1"]),
                                     ("r0-c1-0", ["train.micro_batch_size=2"])]  # fmt: skip
    assert len({s[2] for s in seen}) == 2  # a fresh rendezvous endpoint for each trial
    assert all(m["status"] == "ok" and m["step_times_s"] == [0.5] for m in merged)

    # Node 0 goes away while a follower waits for the next trial: one line, not a hang.
    endpoint = f"127.0.0.1:{free_port()}"
    leader = T_nodes.Leader(endpoint, nnodes=2, search="key", timeout_s=20)
    errors = []

    def orphan():
        try:
            T_nodes.follow(endpoint, node_rank=1, search="key", timeout_s=20,
                           run_here=run_there, say=print)  # fmt: skip
        except T_nodes.NodeLost as e:
            errors.append(str(e))

    thread = threading.Thread(target=orphan)
    thread.start()
    leader.wait_for_nodes(print)
    del leader  # the store's server goes with node 0's process
    thread.join(timeout=30)
    assert not thread.is_alive() and errors and "went away" in errors[0], errors


def test_tune_on_two_nodes_runs_the_same_trials_and_node0_writes(tmp_path, recipe):
    """Two `fsdprun tune` processes on this machine, one CPU rank each, over one endpoint (as
    two nodes would run it): every trial is one job of world size 2 across both, the follower
    runs node 0's trials in node 0's order, both print node 0's report, and only node 0 writes
    trials.jsonl and tuned.yaml. The space is the recipe's tune: section, which the trials'
    training ignores. No confirmation (--confirm 0): its pairs are trials like these, through
    the same path, and would make the test's length depend on which candidate wins."""
    from conftest import free_port, zygote_command

    recipe.write_text(RECIPE + "tune:\n  defaults: false\n  space:\n    "
                      "train.micro_batch_size: [1, 2]\n")  # fmt: skip

    endpoint = f"127.0.0.1:{free_port()}"
    # Both through the suite's zygote (its own process each, as run_fsdprun's), and so their
    # trials: side by side, as two nodes run.
    fsdprun = zygote_command(tmp_path)
    procs = [subprocess.Popen(
        [fsdprun, "tune", str(recipe), "--out", str(tmp_path / f"o{n}"), "--nnodes", "2",
         "--node-rank", str(n), "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
         "--steps", "2", "--repeats", "1", "--finalists", "1", "--device-memory", "1GB",
         "--confirm", "0", "--budget", "5m", "--json"],
        cwd=tmp_path, env=fsdprun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    ) for n in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-2000:]
    node0, node1 = (json.loads(out) for out, _ in outs)
    o0, o1 = tmp_path / "o0", tmp_path / "o1"
    records = trials_of(o0)
    assert [r["id"] for r in records] == ["r0-c0-0", "r0-c1-0"]
    assert all(r["status"] == "ok" and r["world_size"] == 2 for r in records), records
    assert node1.pop("node_rank") == 1 and node1 == node0  # the follower prints node 0's report
    assert node0["nnodes"] == 2 and "(2 node(s))" in node0["hardware"]
    tuned = load_recipe(str(o0 / "tuned.yaml"), []).config  # trains: the section is inert
    assert "tune" not in yaml.safe_load((o0 / "tuned.yaml").read_text())
    assert [f"train.micro_batch_size={tuned.train.micro_batch_size}"] == (
        node0["winner_overrides"] or ["train.micro_batch_size=1"]
    )  # fmt: skip
    assert sorted(p.name for p in o1.iterdir()) == ["node-1"]  # nothing of node 0's there
    for r in records:  # node 1's part of each trial ran the same candidate
        ran = yaml.safe_load((o1 / "node-1" / "trials" / r["id"] / "recipe.yaml").read_text())
        mine = yaml.safe_load((Path(r["run_dir"]) / "recipe.yaml").read_text())
        assert ran["train"] == mine["train"] and ran["launch"]["node_rank"] == 1


def test_a_search_continues_from_another_endpoint_and_its_nodes_agree_but_node_rank():
    def args(*launch: str):
        return T.TuneArgs(recipe="r", overrides=["optim.lr=1"], launch_overrides=list(launch),
                          launch_flags=[], out_dir=Path("o"), budget_s=60)  # fmt: skip

    node0 = args("launch.nnodes=2", "launch.node_rank=0", "launch.rdzv_endpoint=h0:29500")
    node1 = args("launch.nnodes=2", "launch.node_rank=1", "launch.rdzv_endpoint=h0:29500")
    requeued = args("launch.nnodes=2", "launch.node_rank=0", "launch.rdzv_endpoint=h7:29500")
    three = args("launch.nnodes=3", "launch.node_rank=0", "launch.rdzv_endpoint=h0:29500")
    space = [T_space.SpaceKnob("train.micro_batch_size", ("1", "2"))]
    assert T._nodes_key(node0) == T._nodes_key(node1) != T._nodes_key(three)
    assert T._search_key(node0, space) == T._search_key(requeued, space)
    assert T._search_key(node0, space) != T._search_key(three, space)


def test_slurm_steps_map_to_tune_as_to_train(monkeypatch, tmp_path):
    """One task per node with --nnodes: each task is its node's tune, the flags become the same
    launch overrides as train's, and its trials (whose `train` gets --nnodes as an override)
    are launchers too, not workers. A task of a multi-task step is a worker: refused, one line."""
    from typer.testing import CliRunner

    from fsdprun.cli import app
    from fsdprun.launch.slurm import srun_env

    per_node = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
                "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "7",
                "SLURM_STEP_NODELIST": "node[0-1]"}  # fmt: skip
    saved = dict(os.environ)
    try:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        os.environ.update(per_node)
        seen = {}
        monkeypatch.setattr(T, "tune", lambda args, say=None: seen.setdefault("args", args))
        result = CliRunner().invoke(app, [
            "tune", "debug", "--out", str(tmp_path / "o"), "--nnodes", "2", "--node-rank", "1",
            "--nproc-per-node", "1", "--rdzv-endpoint", "node0:29500", "--dry-run",
        ])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "RANK" not in os.environ
        assert seen["args"].launch_overrides == [
            "launch.nproc_per_node=1", "launch.nnodes=2", "launch.node_rank=1",
            "launch.rdzv_endpoint=node0:29500",
        ]  # fmt: skip
        assert srun_env(os.environ) != {}  # a bare `fsdprun train` here would be a worker
        assert (
            srun_env(T_trials.trial_env("r0-c0-0")) == {}
        )  # a trial's train is its node's launcher
        monkeypatch.undo()
        os.environ.update(SLURM_STEP_TASKS_PER_NODE="2", SLURM_LOCALID="1")  # 2 tasks, 1 node
        result = CliRunner().invoke(app, ["tune", "debug", "--out", str(tmp_path / "o"),
                                          "--device-memory", "1GB", "--dry-run"])  # fmt: skip
        assert result.exit_code == 2
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "not as a worker" in lines[0], result.output
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_the_gpu_benchmark_starts_from_recipes_that_load(tmp_path):
    """scripts/bench_tune.py --gpu (its llama-1b case ran on an H200, 2026-12-04): its starting
    recipes load, pass the checks and start eager at 1 x 8 accumulation (`fsdprun plan` puts
    them at 18 and 39 GiB per GPU: planning them here would cost seconds)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_tune.py"
    spec = importlib.util.spec_from_file_location("bench_tune", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert set(bench.GPU_CASES) == {"llama-1b", "llama-8b-layers"}
    for name, text in bench.GPU_CASES.items():
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(text)
        cfg = cfg_of(recipe, "launch.nproc_per_node=1")  # the benchmark's --nproc-per-node 1
        assert (cfg.train.micro_batch_size, cfg.world_size) == (1, 1)
        assert cfg.train.global_batch_size == 8 and not cfg.compile.enabled


def test_tune_searches_float8_all_gather_where_float8_runs_and_its_filter_as_numerics(
    tmp_path, recipe
):
    """Where the recipe trains in float8 (tensorwise), the default space holds
    precision.float8_all_gather (auto, true, false: the math is the same either way);
    the filter and the mode change the numerics: only with --allow-numerics. float8 runs on CPU
    ranks here through the test-only switch."""
    from conftest import fsdprun_env

    from fsdprun.engines.float8 import TEST_ON_CPU_ENV

    env = fsdprun_env(**{TEST_ON_CPU_ENV: "1"})
    base = tune_cmd(recipe, tmp_path / "o", "precision.float8=tensorwise", "--device-memory",
                    "1GB", "--dry-run", "--json")  # fmt: skip
    numerics = ["--space", "defaults", "--space", "precision.float8_filter=default,skip_small"]
    refused = run_fsdprun(*base, *numerics, cwd=tmp_path, env=env)
    assert refused.returncode == 2 and "--allow-numerics" in refused.stderr, refused.stderr
    # The default space (`defaults`) and the filter beside it: one dry run plans both.
    proc = run_fsdprun(*base, *numerics, "--allow-numerics", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    space = {k["key"]: k["values"] for k in json.loads(proc.stdout)["space"]}
    assert space["precision.float8_all_gather"] == ["auto", "true", "false"]
    assert space["precision.float8_filter"] == ["default", "skip_small"]
