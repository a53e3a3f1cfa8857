"""`fsdprun tune` searches context parallel where the plan needs it (issue 42): a recipe whose
plan does not fit the device memory without splitting its rows gets `parallel.cp` in its
default space, each degree tried only where the same candidate at cp 1 does not fit; a recipe
that fits is searched as before. Planned, not trained (--dry-run): that cp trains as one rank
is tests/test_cp.py's."""

from __future__ import annotations

import json

from tests.conftest import run_fsdprun

# The debug model at seq 8,192 on 4 ranks: about 113 MiB planned per rank at cp 1, 60 at cp 2,
# 31 at cp 4. Every knob but activation checkpointing (and cp) held at one value.
LONG = ["debug", "train.seq_len=8192", "model.max_seq_len=8192", "model.n_kv_heads=4",
        "train.micro_batch_size=1", "--nproc-per-node", "4", "--dry-run", "--json",
        "--space", "defaults"] + [f"--space={kv}" for kv in (
            "fsdp.engine=fsdp2", "fsdp.sharding=full", "fsdp.forward_prefetch=0",
            "fsdp.limit_all_gathers=true", "train.loss=plain", "fsdp.cpu_offload=false",
            "train.micro_batch_size=1",
            # Pipeline parallel is searched too where the plan does not fit (test_pp.py).
            "parallel.pp=1")]  # fmt: skip


def _dry_run(tmp_path, memory: str) -> dict:
    proc = run_fsdprun("tune", *LONG, "--device-memory", memory, "--out", str(tmp_path / memory),
                       cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_tune_searches_cp_where_the_plan_does_not_fit_without_it(tmp_path):
    report = _dry_run(tmp_path, "100MB")
    space = {k["key"]: k["values"] for k in report["space"]}
    assert space["parallel.cp"] == ["1", "2", "4"]
    by_label = {c["label"]: c for c in report["candidates"]}
    base, cp2, cp4 = by_label["baseline"], by_label["cp=2"], by_label["cp=4"]
    assert base["planned_peak_bytes"] * 1.1 > 100e6  # 100 MB with the margin: it does not fit
    # Activations dominate: each cp degree about halves the planned peak, and fits.
    assert 0.45 < cp2["planned_peak_bytes"] / base["planned_peak_bytes"] < 0.6
    assert 0.45 < cp4["planned_peak_bytes"] / cp2["planned_peak_bytes"] < 0.6
    assert cp2["status"] == cp4["status"] == "kept" and cp2["overrides"] == ["parallel.cp=2"]
    assert {"c0", cp2["candidate"], cp4["candidate"]} <= set(report["order"])
    # Full checkpointing fits at cp 1; with cp as well it is kept too (its cp 1 twin without
    # either memory knob, the baseline, does not fit), never pruned as refused.
    assert by_label["ac=full"]["status"] == "kept"
    assert all(c["status"] == "kept" or "margin > device memory" in c["reason"]
               for c in report["candidates"])  # fmt: skip


def test_tune_leaves_cp_out_where_the_plan_fits(tmp_path):
    report = _dry_run(tmp_path, "1GB")
    assert "parallel.cp" not in {k["key"] for k in report["space"]}
    assert len(report["candidates"]) == 3  # activation checkpointing's three modes


def test_tune_trusts_a_trials_measured_peak_over_the_plan(tmp_path, monkeypatch):
    """The plan once promised the ring at cp 4 a third of what it used (issue 51): once a trial
    has measured a candidate, tune judges its memory by the measurement, not the plan. A
    continued `fsdprun tune` (the same --out) whose log says mb=2 ran out of memory prunes it
    for that, and so no longer spares ac=full mb=2 its memory knob (the plan said mb=2 fits):
    it is tried; ac=full at mb=1 stays pruned, its twin's trial measured it fitting. The trials
    are records as a GPU's would be (peak allocated), made by a stand-in for the `train` child;
    the command line, the space, the log and the pruning are tune's own."""
    from typer.testing import CliRunner

    from fsdprun.cli import app
    from fsdprun.tools.tune import search as T_search

    def fake_trial(recipe, overrides, cand, *, tid, round_, warmup, out_dir, timeout_s):
        oom = cand.knobs["train.micro_batch_size"] == "2" and "activation_checkpointing.mode" \
            not in cand.diff  # fmt: skip
        times = [0.1] * round_.measured_steps
        return {"event": "trial", "id": tid, "candidate": cand.id, "label": cand.label,
                "round": round_.index, "status": "oom" if oom else "ok",
                "reason": "exit 1: CUDA out of memory" if oom else None, "wall_s": 1.0,
                "step_times_s": times, "tokens_per_step": 100, "losses": [5.0, 4.9, 4.8],
                "peak_bytes": 2**20, "model_state_bytes": 2**10, "memory_kind": "allocated",
                "mfu": None, "time_to_first_step_s": 0.5}  # fmt: skip

    monkeypatch.setattr(T_search, "run_trial", fake_trial)
    monkeypatch.chdir(tmp_path)
    fixed = [f"--space={kv}" for kv in (
        "fsdp.engine=fsdp2", "fsdp.sharding=full", "fsdp.forward_prefetch=0",
        "fsdp.limit_all_gathers=true", "train.loss=plain", "fsdp.cpu_offload=false",
        "train.micro_batch_size=1,2", "activation_checkpointing.mode=none,full")]  # fmt: skip
    args = ["tune", "debug", "train.global_batch_size=16", "train.micro_batch_size=1",
            "--nproc-per-node", "2", "--device-memory", "1GB", "--out", "o", "--space",
            "defaults", *fixed, "--json"]  # fmt: skip
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    rows = {r["label"]: r for r in json.loads(first.stdout)["candidates"]}
    assert rows["mb=2"]["status"] == "oom", rows["mb=2"]
    assert "not needed" in rows["ac=full mb=2"]["reason"]  # the plan says mb=2 fits
    again = CliRunner().invoke(app, args[:-1])  # as printed: the pruning's reasons
    assert again.exit_code == 0, again.output
    out = again.output
    assert "c1 mb=2: its trial ran out of memory (planned peak" in out, out
    assert "c2 ac=full: activation_checkpointing.mode=full not needed: c0 (without) fits (its " \
           "trial measured it)" in out, out  # fmt: skip
    (order,) = [line for line in out.splitlines() if line.startswith("order")]
    assert order.endswith("c0 baseline, c3 ac=full mb=2"), order
    tried = {json.loads(line).get("label") for line in (tmp_path / "o/trials.jsonl").open()}
    assert "ac=full mb=2" in tried, tried
