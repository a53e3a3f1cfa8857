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
            "train.micro_batch_size=1")]  # fmt: skip


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
