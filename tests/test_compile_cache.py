"""`compile.cache_dir` (where torch's compile caches go) and the summary's compile figures: the
key's resolution and checks, the refusal of a folder that cannot be written, and the rendering.

The compiled run that fills a fresh cache and reuses it is in tests/test_perf.py
(`test_compile_per_block_fills_the_cache_dir_and_a_second_run_hits_it`): one compile for both.
"""

from __future__ import annotations

import sys
import types

import pytest
from conftest import read_tables, run_fsdprun
from rich.console import Console

from fsdprun.compile_cache import combine_ranks, compile_stats
from fsdprun.config import load_recipe
from fsdprun.errors import UserError
from fsdprun.report.console import Reporter, compile_rows


def test_cache_dir_is_relative_to_the_recipe_that_sets_it(tmp_path, monkeypatch):
    recipe = tmp_path / "sub" / "my.yaml"
    recipe.parent.mkdir()
    recipe.write_text("extends: debug\ncompile:\n  enabled: true\n  cache_dir: cache/inductor\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_recipe(str(recipe)).config
    assert cfg.compile.cache_dir == str(tmp_path / "sub" / "cache" / "inductor")
    # On the command line: relative to the working directory.
    cfg = load_recipe(str(recipe), ["compile.cache_dir=mine"]).config
    assert cfg.compile.cache_dir == str(elsewhere / "mine")
    assert load_recipe("debug").config.compile.cache_dir is None  # torch's default


@pytest.mark.parametrize(
    ("value", "problem"), [("", "is empty"), ("a-file", "is not a folder")], ids=["empty", "file"]
)
def test_a_cache_dir_that_is_not_a_folder_is_refused_in_one_line(tmp_path, monkeypatch, value,
                                                                 problem):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError) as info:
        load_recipe("debug", [f"compile.cache_dir={value}"])
    message = str(info.value)
    assert "\n" not in message and message.startswith("compile.cache_dir: "), message
    assert problem in message and "a folder for torch's compile caches, or null" in message


def test_train_refuses_a_cache_dir_it_cannot_create_before_launch(tmp_path):
    (tmp_path / "a-file").write_text("")
    proc = run_fsdprun(
        "train", "debug", "compile.enabled=true", "compile.cache_dir=a-file/cache",
        "--run-dir", "run", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (
        f"error: compile.cache_dir: cannot write {tmp_path}/a-file/cache (not a directory); give "
        "a folder this user can write, on storage every node reaches, or drop the key "
        "(~compile.cache_dir) for torch's default"
    )
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_compile_figures_degrade_to_none_where_torch_lacks_them(monkeypatch):
    # A torch whose dynamo module has neither the timing function nor the counters.
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", types.ModuleType("torch._dynamo.utils"))
    stats = compile_stats()
    assert stats is not None
    assert stats["time_s"] is None and stats["fx_graph"] is None and stats["aot_autograd"] is None
    assert compile_rows(combine_ranks([stats, stats])) == [
        ("compile time", "n/a"), ("FX graph cache", "n/a"), ("AOTAutograd cache", "n/a"),
    ]  # fmt: skip
    monkeypatch.delitem(sys.modules, "torch._dynamo.utils")
    assert compile_stats() is None  # torch.compile never ran in this process


def _rank(time_s: float, fx: tuple[int, int, int], aot: tuple[int, int, int]) -> dict:
    return {"time_s": time_s, "fx_graph": dict(zip(("hit", "miss", "bypass"), fx, strict=True)),
            "aot_autograd": dict(zip(("hit", "miss", "bypass"), aot, strict=True)),
            "cache_dir": "/shared/inductor"}  # fmt: skip


def test_summary_shows_the_slowest_ranks_compile_time_and_every_ranks_cache_counts():
    compiled = combine_ranks(
        [_rank(21.5, (0, 4, 0), (0, 2, 0)), _rank(23.25, (1, 3, 1), (0, 2, 0))]
    )
    assert compiled == {"time_s": 23.25, "fx_graph": {"hit": 1, "miss": 7, "bypass": 1},
                        "aot_autograd": {"hit": 0, "miss": 4, "bypass": 0},
                        "cache_dir": "/shared/inductor"}  # fmt: skip
    assert combine_ranks([None, None]) is None
    start = {
        "event": "start", "recipe": "debug", "num_params": 131_000, "world_size": 2, "nnodes": 1,
        "device_name": "CPU (x86_64)", "backend": "gloo", "engine": "fsdp2", "fsdp_units": [],
        "param_dtype": "fp32", "reduce_dtype": "fp32", "activation_checkpointing": "none",
        "compile": "per block", "compile_cache": "/shared/inductor (compile.cache_dir)",
        "global_batch_size": 8, "seq_len": 64, "tokens_per_step": 512, "micro_batch_size": 2,
        "grad_accum_steps": 2, "steps": 2, "param_shard_bytes": 2**20, "param_bytes": 2**21,
        "run_dir": "runs/x",
    }  # fmt: skip
    summary = {
        "event": "summary", "final_loss": 4.5, "wall_time_s": 30.0, "timing_warmup_steps": 1,
        "flops_per_token": 786_432, "mfu_note": "no peak figure for CPUs",
        "metrics_file": "runs/x/metrics.jsonl",
        "throughput": {"tokens_per_s": 7500.0, "tokens_per_s_per_device": 3750.0,
                       "step_time_p50_s": 0.068, "step_time_p90_s": 0.0825,
                       "tflops_per_device": 0.003, "mfu": None, "steps_measured": 28},
        "ranks": [{"rank": 0, "peak_rss_bytes": 2**28, "model_state_bytes": None}],
        "compile": compiled,
    }  # fmt: skip
    console = Console(record=True, width=80)
    reporter = Reporter(console, live=False)
    reporter.handle(start)
    reporter.handle(summary)
    text = console.export_text()
    assert "\n  compile cache: /shared/inductor (compile.cache_dir)\n" in text
    rows = dict(read_tables(text)["Throughput"][1])
    assert rows["compile time"] == "23.2 s"
    assert rows["FX graph cache"] == "1 of 8 hit, 1 bypassed"
    assert rows["AOTAutograd cache"] == "0 of 4 hit"
    # A summary of an eager run (or of an older fsdprun) has no compile rows.
    console = Console(record=True, width=80)
    Reporter(console, live=False).handle({**summary, "compile": None})
    assert "compile time" not in console.export_text()
    del summary["compile"]
    Reporter(Console(record=True, width=80), live=False).handle(summary)
