"""TensorBoard and W&B trackers through the real commands (CPU, gloo, 2 ranks): what they hold is
read back with their own readers (TensorBoard's EventAccumulator; W&B's offline .wandb files
parsed into W&B's protobuf records) and compared with metrics.jsonl, across an elastic restart
and a resume from an older checkpoint."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import Run, fsdprun_env, run_fsdprun

pytest.importorskip(
    "tensorboard", reason="the tensorboard extra: pip install 'fsdprun[tensorboard]'"
)
pytest.importorskip("wandb", reason="the wandb extra: pip install 'fsdprun[wandb]'")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

GIB = 2**30


def tensorboard_run(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-log blocks of
    32 KiB holding chunks (crc32c, length, type: full/first/middle/last) of protobuf records."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, records, partial = 7, [], b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is zero padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        partial += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(partial)
            records.append(record)
            partial = b""
    return records


def wandb_sessions(run_dir: Path) -> list[dict]:
    """Each offline W&B session of the run, in the order it ran: its run id and history rows."""
    sessions = []
    for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        records = wandb_records(path)
        rows = [
            {item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"
        ]  # fmt: skip
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        sessions.append({"id": run.run_id, "project": run.project, "rows": rows})
    return sorted(sessions, key=lambda s: s["rows"][0]["_timestamp"])


def latest_by_step(events: list[dict], kind: str) -> dict[int, dict]:
    """metrics.jsonl's records of one kind by step; a step logged again (a resume from an older
    checkpoint) counts with its latest record."""
    return {e["step"]: e for e in events if e["event"] == kind}


def test_trackers_follow_an_elastic_restart_and_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    # A constant learning rate: the resume's longer train.steps leaves the replayed steps' lr
    # as it was (W&B keeps the values first logged for a step).
    common = ["output.log_every=1", "launch.max_restarts=1", "schedule.decay=constant"]
    # Rank 1 fails at step 5 after steps 1-4 are logged: the restart continues from step 3 and
    # logs step 4 again.
    proc = run_fsdprun(
        "train", "debug", "train.steps=8", "checkpoint.every_steps=3", "eval.every_steps=4",
        "data.val_fraction=0.1", "output.tensorboard=true", "output.peak_tflops=0.001",
        "output.wandb={project: trackers-test, mode: offline}", *common,
        "--run-dir", str(run_dir), cwd=tmp_path, env=fsdprun_env(FSDPRUN_FAIL_AT="1:5"),
    )  # fmt: skip
    Run(proc, run_dir).check()
    # The header says where both write.
    assert (f"  trackers: TensorBoard -> {run_dir}/tensorboard/; W&B offline run run -> "
            f"{run_dir}/wandb/\n") in proc.stdout  # fmt: skip
    # Then a resume from step 6 (7 and 8 are logged again) to step 10.
    proc = run_fsdprun(
        "resume", str(run_dir), "--step", "6", "train.steps=10", *common, cwd=tmp_path
    )
    run = Run(proc, run_dir).check()
    steps, evals = latest_by_step(run.events, "step"), latest_by_step(run.events, "eval")
    assert sorted(steps) == list(range(1, 11)) and sorted(evals) == [4, 8, 10]

    tb = tensorboard_run(run_dir)
    fields = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
              "perf/tokens_per_s": "tokens_per_s", "train/tokens_seen": "tokens_seen"}  # fmt: skip
    for tag, key in fields.items():
        logged = tb.Scalars(tag)
        assert [s.step for s in logged] == list(range(1, 11)), tag  # once each, in order
        for s in logged:
            assert s.value == pytest.approx(steps[s.step][key], rel=1e-6), (tag, s.step)
    # MFU of each step: its tokens/s at the FLOPs per token and peak of the summary's MFU.
    summary = run.summary["throughput"]
    for s in tb.Scalars("perf/mfu"):
        want = steps[s.step]["tokens_per_s"] * summary["mfu"] / summary["tokens_per_s"]
        assert s.value == pytest.approx(want, rel=1e-6), s.step
    assert len(tb.Scalars("perf/mfu")) == 10
    for s in tb.Scalars("memory/peak_rss_gib"):
        assert s.value == pytest.approx(steps[s.step]["memory"]["peak_rss_bytes"] / GIB, rel=1e-6)
    assert [(s.step, pytest.approx(s.value, rel=1e-6)) for s in tb.Scalars("val/loss")] == [
        (step, e["val_loss"]) for step, e in sorted(evals.items())
    ]

    def texts(kind: str) -> list[tuple[int, dict]]:
        return [(t.step, json.loads(t.tensor_proto.string_val[0]))
                for t in tb.Tensors(f"events/{kind}/text_summary")]  # fmt: skip

    def fields_of(kind: str) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "event"}
                for e in run.events if e["event"] == kind]  # fmt: skip

    assert texts("restart") == [(3, e) for e in fields_of("restart")]
    assert texts("resume") == [(6, e) for e in fields_of("resume")]
    assert [step for step, _ in texts("checkpoint")] == [3, 6, 8, 9, 10]

    # W&B: one run id over the three sessions; each step once, in order; values of metrics.jsonl.
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    sessions = wandb_sessions(run_dir)
    assert len(sessions) == 3
    assert {(s["id"], s["project"]) for s in sessions} == {(run_id, "trackers-test")}
    rows = [row for s in sessions for row in s["rows"]]
    logged = [row["_step"] for row in rows]
    assert logged == sorted(set(logged)), logged  # never backwards, never twice
    losses = {row["_step"]: row for row in rows if "train/loss" in row}
    assert sorted(losses) == list(range(1, 11))
    for step, row in losses.items():
        # Replayed steps are deterministic: the first session's loss is the latest one's too.
        assert row["train/loss"] == pytest.approx(steps[step]["loss"], abs=1e-6), step
        assert row["train/lr"] == pytest.approx(steps[step]["lr"], rel=1e-9), step
        assert row["train/grad_norm"] == pytest.approx(steps[step]["grad_norm"], rel=1e-5), step
        if step > 8:  # logged by the resume's session alone
            assert row["perf/tokens_per_s"] == steps[step]["tokens_per_s"], step
    assert {row["_step"]: row["val/loss"] for row in rows if "val/loss" in row} == pytest.approx(
        {step: e["val_loss"] for step, e in evals.items()}, abs=1e-6
    )
    restarts = [json.loads(row["events/restart"]) for row in rows if "events/restart" in row]
    assert restarts == fields_of("restart")


def test_wandb_online_without_a_login_is_one_line(tmp_path):
    # No API key anywhere W&B looks (the environment, ~/.netrc, its settings under HOME).
    env = {k: v for k, v in fsdprun_env(HOME=str(tmp_path)).items() if not k.startswith("WANDB_")}
    proc = run_fsdprun(
        "train", "debug", "train.steps=2", "output.wandb={mode: online}",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: output.wandb: W&B could not start")
    assert "use mode: offline" in lines[0]
