"""Pipeline parallelism (`parallel.pp`, docs/pipeline-parallel.md): the refusals before launch,
the layout's rules (mesh, stages per rank, the balanced split, the bubble), the stages of every
family composed in one process against the whole model, and the promise that pp trains exactly
as one rank (1f1b, gpipe, interleaved; pp x dp, pp x tp; an HF Llama folder; packed rows with
the chunked loss and clipping) and resumes through `fsdprun resume` across pp degrees.

The runs train in the session's persistent 4-, 2- and 1-rank gloo groups (tests/gloo_pool.py,
shared with tests/test_tp.py and tests/test_cp.py, whose one-rank references use the same
COMMON); the resumes are `fsdprun resume` commands on copies of the pp run's folder.
"""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import pytest
from conftest import Run, model_at, run_fsdprun
from hf_families import FAMILIES as HF_TINY_FAMILIES

from fsdprun.config import PpSchedule, load_recipe
from fsdprun.config.layout import Layout
from fsdprun.config.schedule import bubble_fraction, in_flight, pp_blocks
from fsdprun.data import BatchLayout
from fsdprun.errors import UserError

FOUR = ["launch.nproc_per_node=4"]
DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"
COMMON = ("model.n_kv_heads=4", "train.steps=3", "train.micro_batch_size=1", "output.log_every=1",
          "checkpoint.every_steps=2", "schedule.warmup_steps=1", "optim.eps=1e-4")  # fmt: skip
LAST = 3
TOL = 1e-5


def errors_of(*overrides: str) -> list[str]:
    with pytest.raises(UserError) as info:
        load_recipe("debug", [*FOUR, *overrides])
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    ("overrides", "phrase"),
    [
        (["parallel.pp=3"], "parallel.pp (3) must divide the world size (4)"),
        (["parallel.pp=4"], "(4 stages) exceeds the model's 2 layers, which would leave a stage "
                            "without a block"),
        (["parallel.pp=2", "parallel.pp_split=[2]"],
         "parallel.pp_split ([2]) must give each of the 2 stages"),
        (["parallel.pp=2", "parallel.pp_split=[2,1]"], "adds up to 3 blocks; the model has 2"),
        (["parallel.pp=2", "train.global_batch_size=4"],
         "parallel.pp_schedule=1f1b needs at least parallel.pp (2) micro-batches a step, got 1"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
         "places several stages on each rank: set parallel.pp_stages_per_rank"),
        (["parallel.pp=2", "parallel.pp_stages_per_rank=2"], "needs an interleaved schedule"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
          "model.n_layers=4", "train.global_batch_size=6", "train.micro_batch_size=1"],
         "needs the micro-batches a step (3) to be a multiple of parallel.pp (2)"),
        (["parallel.pp=2", "fsdp.engine=fsdp1"], "parallel.pp=2 with fsdp.engine=fsdp1"),
        (["parallel.pp=2", "model.tie_embeddings=true"], "parallel.pp=2 with tied embeddings"),
        (["parallel.pp=2", "compile.enabled=true", "compile.per_block=false"],
         "parallel.pp=2 with compile.per_block=false"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_zb", "parallel.pp_stages_per_rank=2",
          "model.n_layers=4"], "parallel.pp=2 with parallel.pp_schedule=interleaved_zb: torch's"),
        (["parallel.pp=2", "parallel.tp=2", "train.global_batch_size=5"],
         "data-parallel ranks (1 = world size / (parallel.pp x parallel.cp x parallel.tp))"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(overrides, phrase):
    errors = errors_of(*overrides)
    assert any(phrase in e for e in errors), errors


def test_refused_on_the_command_line_before_launch_in_one_line(tmp_path):
    """`fsdprun train` refuses a layout pp cannot take in one line, exit 2, nothing launched."""
    proc = run_fsdprun("train", "debug", "parallel.pp=4", "--run-dir", str(tmp_path / "run"),
                       cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "would leave a stage without a block" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_layout_puts_pp_outermost_and_gives_each_rank_its_stages():
    overrides = [*FOUR, "parallel.pp=2", "parallel.tp=2", "train.global_batch_size=4",
                 "train.micro_batch_size=1"]  # fmt: skip
    cfg = load_recipe("debug", overrides).config
    layout = Layout.of(cfg)
    assert layout.mesh_dims == [("pp", 2), ("dp_shard", 1), ("tp", 2)] and layout.dp == 1
    assert [layout.pp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.local_stages(r) for r in range(4)] == [[0], [0], [1], [1]]
    looped = load_recipe("debug", [*FOUR, "parallel.pp=2", "model.n_layers=4",
                                   "parallel.pp_schedule=interleaved_1f1b",
                                   "parallel.pp_stages_per_rank=2"]).config  # fmt: skip
    layout = Layout.of(looped)
    assert layout.mesh_dims == [("pp", 2), ("dp_shard", 2)] and layout.num_stages == 4
    assert layout.local_stages(0) == [0, 2] and layout.local_stages(3) == [1, 3]
    # Both stages of a pipeline read the same samples: ranks 0, 2 and 1, 3.
    batches = BatchLayout.of(layout, looped.train)
    assert [batches.data_rank(r) for r in range(4)] == [0, 1, 0, 1] and batches.num_ranks == 4
    # resume's re-fit: 2 ranks hold pp 2 of a pp 4 x dp 1 run, 3 ranks only pp 1.
    assert layout.at(world_size=2, pp=4).refit("pp") == 2
    assert layout.at(world_size=3, pp=2).refit("pp") == 1


def test_balanced_split_gives_the_head_its_cost_and_every_stage_a_block():
    # llama-70b's shape on 8 stages: the head costs about 1.2 blocks, so the last stage runs 9.
    assert pp_blocks(80, 8, head_cost=1.23) == [10, 10, 10, 10, 10, 10, 11, 9]
    assert pp_blocks(4, 2, head_cost=0.33) == [2, 2]
    assert pp_blocks(5, 2, head_cost=3.0) == [4, 1]
    assert pp_blocks(4, 2, split=[1, 3]) == [1, 3]
    for layers, stages in [(2, 2), (7, 3), (16, 8), (9, 4)]:
        counts = pp_blocks(layers, stages, head_cost=0.5)
        assert sum(counts) == layers and min(counts) >= 1 and len(counts) == stages


def test_bubble_and_in_flight_follow_the_schedules():
    one = PpSchedule.one_f_one_b
    assert bubble_fraction(one, 4, 8) == pytest.approx(3 / 11)  # (pp - 1) / (m + pp - 1)
    assert bubble_fraction(PpSchedule.gpipe, 4, 8) == bubble_fraction(one, 4, 8)
    assert bubble_fraction(PpSchedule.interleaved_1f1b, 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(one, 1, 8) == 0
    assert in_flight(PpSchedule.gpipe, 4, 8) == 8 and in_flight(one, 4, 8) == 4
    assert in_flight(one, 4, 2) == 2


def _tiny(model_type: str | None, folder: Path | None):
    """A small model on the CPU with random weights: the built-in Llama of the debug recipe
    (4 layers), or the tiny HF folder."""
    import torch

    from fsdprun.models import build_model

    torch.manual_seed(0)
    overrides = ["model.n_layers=4"] if folder is None else [f"model.hf_path={folder}"]
    cfg = load_recipe("debug", overrides).config
    with torch.device("cpu"):
        model = build_model(cfg.model)
    if folder is None:
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.05)
        model.init_buffers(torch.device("cpu"))
    return cfg, model


@pytest.mark.parametrize("family", [None, *HF_TINY_FAMILIES])
def test_stages_of_every_family_compose_to_the_whole_model(family, hf_family_dirs):
    """Each family's model pruned to its stages (two stages, and under an interleaved layout two
    shells of one rank's pruned model) gives the whole model's loss when the stages run in turn,
    and keeps every parameter's name: the stages' names are disjoint and together the whole
    model's (what lets a checkpoint resume on any pp degree)."""
    import torch

    from fsdprun.config.model_facts import model_facts
    from fsdprun.engines.pp import prune_model, stage_parts
    from fsdprun.loss import cross_entropy

    cfg, whole = _tiny(family, hf_family_dirs[family] if family else None)
    facts = model_facts(cfg.model)
    if facts.tie_embeddings:  # Gemma's: refused under pp (test_refusals_name_the_key)
        return
    stages = facts.entry.stages
    tokens = torch.randint(3, 256, (2, 64))
    targets = torch.randint(3, 256, (2, 64))
    with torch.no_grad():
        want = cross_entropy(whole(tokens), targets, reduction="sum")
        layers = whole.args.n_layers
        names = {n for n, _ in whole.named_parameters()}
        # pp 2, one stage a rank: rank 0 runs stage 0, rank 1 stage 1.
        counts = [1, layers - 1]
        ranks = [copy.deepcopy(whole) for _ in range(2)]
        for rank, model in enumerate(ranks):
            prune_model(model, stages=stages, counts=counts, local=[rank])
        hidden = ranks[0].forward_hidden(tokens)
        got = cross_entropy(ranks[1](hidden), targets, reduction="sum")
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        kept = [{n for n, _ in m.named_parameters()} for m in ranks]
        assert not kept[0] & kept[1] and kept[0] | kept[1] == names
        if layers < 4:
            return
        # Interleaved: 4 stages of one block, this rank holding stages 0 and 2, the other 1, 3.
        ranks = [copy.deepcopy(whole) for _ in range(2)]
        plans = [prune_model(m, stages=stages, counts=[1] * 4, local=[r, r + 2])
                 for r, m in enumerate(ranks)]  # fmt: skip
        parts = [stage_parts(m, stages=stages, plan=p, local=[r, r + 2])
                 for r, (m, p) in enumerate(zip(ranks, plans, strict=True))]  # fmt: skip
        h = parts[0][0].forward_hidden(tokens)
        h = parts[1][0].forward_hidden(h)
        h = parts[0][1].forward_hidden(h)
        got = cross_entropy(parts[1][1](h), targets, reduction="sum")
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        kept = [{n for n, _ in m.named_parameters()} for m in ranks]
        assert kept[0] | kept[1] == names and not kept[0] & kept[1]


@pytest.fixture(scope="module")
def pools(gloo_pool_4, gloo_pool, gloo_pool_1):
    """The session's 4-, 2- and 1-rank groups (tests/conftest.py)."""
    return {4: gloo_pool_4, 2: gloo_pool, 1: gloo_pool_1}


def _ckpt(run, step: int) -> Path:
    from fsdprun.checkpoint import step_dir

    return step_dir(run.run_dir, step)


def _assert_same(run, ref, tmp: Path, *, steps=(1, 2, 3)):
    got = {e["step"]: e for e in run.steps}
    want = {e["step"]: e for e in ref.steps}
    for step in steps:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=TOL), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=TOL), step
        assert got[step]["trained_tokens"] == want[step]["trained_tokens"], step
    mine, theirs = model_at(run, LAST, tmp), model_at(ref, LAST, tmp)
    assert mine.keys() == theirs.keys()
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    assert worst <= TOL, worst


def _header(start: dict) -> str:
    from rich.console import Console

    from fsdprun.report.console import Reporter

    console = Console(record=True, width=220, highlight=False)
    Reporter(console, live=False).handle(start)
    return console.export_text()


@pytest.fixture(scope="module")
def pp_run(pools) -> Run:
    """pp 2 x dp 2 (1f1b, 4 micro-batches a step) with activation checkpointing, trained by the
    worker's own loop in the session's 4-rank group (the resumes below are `fsdprun resume`
    commands on copies of its folder)."""
    return pools[4].train(*COMMON, "parallel.pp=2", "activation_checkpointing.mode=full")


def test_pp2_dp2_trains_as_one_rank(pp_run, pools, tmp_path):
    """The losses (on the last stage, brought to rank 0), gradient norms (over both stages),
    trained-token counts and every trained parameter of pp 2 x dp 2 equal one rank's; the
    header says the mesh and the pipeline; each rank holds half of its stage's parameters."""
    start = pp_run.start
    assert start["mesh"] == [["pp", 2], ["dp_shard", 2]] and start["grad_accum_steps"] == 4
    assert start["pipeline"]["blocks"] == [1, 1] and start["pipeline"]["in_flight"] == 2
    _assert_same(pp_run, pools[1].train(*COMMON), tmp_path)
    out = _header(start)
    assert "mesh: 2 pp x 2 dp_shard" in out, out
    assert "512 tokens/step (micro 1 x 2 dp ranks x 4 accumulation)" in out
    assert ("pipeline parallel: pp 2, 1f1b schedule, 2 stages (blocks 1 | 1); 4 micro-batches a "
            "step, up to 2 in flight on stage 0; bubble 20% of each step") in out  # fmt: skip
    # The summary's memory table says which stage each rank's memory holds.
    summary = pp_run.summary
    assert [r["stages"] for r in summary["ranks"]] == [[0], [0], [1], [1]]
    table = _header(summary)
    assert re.search(r"rank\s*┃\s*stages", table) and re.search(r"│\s+3\s+│\s+1\s+│", table), table


@pytest.mark.parametrize(
    ("overrides", "layers"),
    [(("parallel.pp_schedule=1f1b",), 2), (("parallel.pp_schedule=gpipe",), 2),
     (("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"), 4)],
    ids=["1f1b", "gpipe", "interleaved"],
)  # fmt: skip
def test_pp2_schedules_train_as_one_rank(overrides, layers, pools, tmp_path):
    """pp 2 on 2 ranks (8 micro-batches a step) under each schedule equals one rank; the
    interleaved one runs 4 stages of one block, two on each rank."""
    model = () if layers == 2 else (f"model.n_layers={layers}",)
    run = pools[2].train(*COMMON, *model, "parallel.pp=2", *overrides)
    assert run.start["mesh"] == [["pp", 2], ["dp_shard", 1]]
    assert len(run.start["pipeline"]["blocks"]) == layers
    _assert_same(run, pools[1].train(*COMMON, *model), tmp_path)


def test_pp2_tp2_trains_as_one_rank(pools, tmp_path):
    """pp 2 x tp 2 (the mesh `2 pp x 1 dp_shard x 2 tp`): each stage's blocks split by the TP
    plan, the embedding split on stage 0 and the norm and vocab-sharded output (loss parallel)
    on stage 1; sequence-sharded activations between the stages."""
    run = pools[4].train(*COMMON, "parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=2")
    assert run.start["mesh"] == [["pp", 2], ["dp_shard", 1], ["tp", 2]]
    _assert_same(run, pools[1].train(*COMMON), tmp_path)


CHAT = ("data.source=chat", f"data.paths=[{DATA / 'chat.jsonl'}]",
        f"data.tokenizer={DATA / 'tiny-llama-hf'}", "data.truncate=truncate",
        "model.vocab_size=258", "data.val_fraction=0.2", f"eval.every_steps={LAST}",
        "eval.batches=1", "train.grad_clip=0.05", "optim.eps=1", "optim.lr=0.5")  # fmt: skip


def test_packed_chat_rows_with_chunked_loss_clipping_and_eval_train_as_one_rank(pools, tmp_path):
    """Packed chat rows (positions and document ids reach both stages with each micro-batch),
    masked targets (N counted once per pipeline), the chunked loss on the last stage, a clip far
    below the norm (on the global norm over both stages) and hybrid sharding (the 3-D mesh
    `2 pp x 2 dp_replicate x 1 dp_shard`) against one rank with torch's own clip (the ddp
    engine) and the plain loss: losses, counts, norms, parameters, and the validation loss
    (evaluated through the pipeline). optim.eps=1 so that AdamW's step follows the clipped
    gradient's scale (tests/test_tp.py)."""
    run = pools[4].train(*COMMON, *CHAT, "parallel.pp=2", "train.loss=chunked",
                         "fsdp.sharding=hybrid", "fsdp.shard_group_size=1")  # fmt: skip
    one = pools[1].train(*COMMON, *CHAT, "fsdp.engine=ddp")
    assert run.start["mesh"] == [["pp", 2], ["dp_replicate", 2], ["dp_shard", 1]]
    assert all(e["grad_norm"] > 0.5 for e in run.steps)
    assert run.steps[0]["trained_tokens"] < 8 * 64  # prompts and padding are not trained
    _assert_same(run, one, tmp_path)
    assert run.summary["final_val_loss"] == pytest.approx(one.summary["final_val_loss"], abs=TOL)


def test_hf_llama_folder_trains_as_one_rank(pools, hf_family_dirs, tmp_path, monkeypatch):
    """An HF Llama folder at pp 2: its embed_tokens on stage 0, norm and lm_head on stage 1, the
    rotary embedding on both; equal to one rank."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = (f"model.hf_path={hf_family_dirs['llama']}",)
    run = pools[4].train(*COMMON, *data, "parallel.pp=2")
    assert run.start["mesh"] == [["pp", 2], ["dp_shard", 2]]
    _assert_same(run, pools[1].train(*COMMON, *data), tmp_path)


FLOAT8 = ("precision.float8=tensorwise", "model.ffn_dim=200", "model.n_kv_heads=4",
          "train.steps=2", "train.seq_len=32", "train.global_batch_size=4",
          "train.micro_batch_size=1", "output.log_every=1", "schedule.warmup_steps=1",
          "optim.eps=1e-4", "checkpoint.save_final=false")  # fmt: skip


def test_float8_under_pp_trains_as_one_rank_float8(pools):
    """tensorwise float8 at pp 2 x dp 2 (1f1b over 2 micro-batches), each stage's converted
    Linears' weights all-gathered in float8 (auto: FSDP shards them over 2 ranks): the losses and
    gradient norms of the one-rank float8 run of tests/test_tp.py's config (1e-5)."""
    pytest.importorskip("torchao")
    from fsdprun.engines.float8 import TEST_ON_CPU_ENV

    env = {TEST_ON_CPU_ENV: "1"}
    one = pools[1].train(*FLOAT8, env=env)
    run = pools[4].train(*FLOAT8, "parallel.pp=2", env=env)
    assert "float8 all-gather on (auto" in run.start["float8"], run.start["float8"]
    for mine, theirs in zip(run.steps, one.steps, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=TOL)


def _stopped_at_2(run, tmp_path: Path) -> Path:
    """A copy of `run`'s folder as if it had stopped after its step-2 checkpoint."""
    copy_ = tmp_path / "run"
    shutil.copytree(run.run_dir, copy_)
    shutil.rmtree(_ckpt(Run(None, copy_), LAST))
    return copy_


def _resumed(run_dir: Path, tmp_path: Path, *overrides: str) -> Run:
    proc = run_fsdprun("resume", str(run_dir), *overrides, "--nproc-per-node", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    again = Run(proc, run_dir)
    last = max(i for i, e in enumerate(again.events) if e["event"] == "start")
    again.events = again.events[last:]
    return again


def test_resume_is_exact_from_pp_to_dp_and_back(pp_run, pools, tmp_path):
    """`fsdprun resume` of the pp 2 x dp 2 run stopped after its step-2 checkpoint, on dp 4
    (parallel.pp=1): step 3 equals the uninterrupted run's; and a dp 4 run stopped there resumes
    on pp 2 x dp 2 to the same step 3 (DCP reads each stage's names wherever they were saved).
    `inspect-checkpoint` shows the mesh the pp checkpoint was saved on."""
    proc = run_fsdprun("inspect-checkpoint", str(_ckpt(pp_run, 2)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"mesh\s+2 pp × 2 dp_shard", proc.stdout), proc.stdout
    again = _resumed(_stopped_at_2(pp_run, tmp_path / "a"), tmp_path, "parallel.pp=1")
    assert again.start["mesh"] == [["dp", 4]] and [e["step"] for e in again.steps] == [LAST]
    _assert_same(again, pp_run, tmp_path, steps=(LAST,))
    dp4 = pools[4].train(*COMMON)
    again = _resumed(_stopped_at_2(dp4, tmp_path / "b"), tmp_path, "parallel.pp=2")
    assert again.start["mesh"] == [["pp", 2], ["dp_shard", 2]]
    _assert_same(again, dp4, tmp_path, steps=(LAST,))


def _heartbeat(run_dir: Path, rank: int) -> dict | None:
    import json
    from contextlib import suppress

    with suppress(OSError, ValueError):
        return json.loads((run_dir / "heartbeat" / f"rank-{rank}.json").read_text())
    return None


def _wait_for_step(run_dir: Path, step: int, proc, ranks=(0, 1)) -> list[dict]:
    import time

    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        beats = [_heartbeat(run_dir, r) for r in ranks]
        if all(b is not None and b["step"] >= step for b in beats):
            return beats
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step}: {proc.poll()}")


KILLED = ("parallel.pp=2", "train.steps=6", "checkpoint.every_steps=2", "output.log_every=1",
          "schedule.warmup_steps=1", "launch.monitor_interval_s=1")  # fmt: skip


def test_a_killed_stage_stops_the_run_in_one_line_and_keeps_its_checkpoint(tmp_path):
    """kill -9 of the last stage's rank while the first stage waits at step 5 (FSDPRUN_HANG_AT):
    the launcher says which rank died in one line (exit 1), no process of the run is left, and
    the step-4 checkpoint is whole. On the way, the non-finite drill on the last stage at step 2
    (its loss made infinite) is skipped by every rank: the agreement reads the global norm."""
    import os
    import signal

    from conftest import fsdprun_env, processes_naming, start_fsdprun

    from fsdprun.checkpoint import step_dir, verify_checkpoint

    run_dir = tmp_path / "run"
    env = fsdprun_env(FSDPRUN_HANG_AT="0:5", FSDPRUN_NONFINITE_AT="1:2")
    proc = start_fsdprun("train", "debug", *KILLED, "train.nonfinite=skip", "--run-dir",
                         str(run_dir), cwd=tmp_path, env=env)  # fmt: skip
    try:
        victim = _wait_for_step(run_dir, 5, proc, ranks=(1,))[0]
        while not (step_dir(run_dir, 4) / ".metadata").exists():  # noqa: ASYNC110
            assert proc.poll() is None
        os.kill(victim["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    killed = f"error: rank 1 was killed by SIGKILL at step 5 (pid {victim['pid']})"
    assert lines[0].startswith(killed), lines
    assert processes_naming(str(run_dir)) == []
    assert verify_checkpoint(step_dir(run_dir, 4)) == []
    run = Run(None, run_dir)
    skips = [e for e in run.events if e["event"] == "skip"]
    assert [e["step"] for e in skips] == [2]
    assert [e["step"] for e in run.steps if e["skipped"]] == [2]


def test_a_killed_stage_restarts_from_its_checkpoint_exactly(pools, tmp_path):
    """The same kill with launch.max_restarts=1: the workers restart from the step-4 checkpoint
    and steps 5 and 6 equal an uninterrupted pp 2 run's (the pool's) to 1e-6."""
    import os
    import signal

    from conftest import fsdprun_env, start_fsdprun

    from fsdprun.checkpoint import step_dir

    run_dir = tmp_path / "run"
    env = fsdprun_env(FSDPRUN_HANG_AT="0:5")
    proc = start_fsdprun("train", "debug", *KILLED, "launch.max_restarts=1", "--run-dir",
                         str(run_dir), cwd=tmp_path, env=env)  # fmt: skip
    try:
        victim = _wait_for_step(run_dir, 5, proc, ranks=(1,))[0]
        while not (step_dir(run_dir, 4) / ".metadata").exists():  # noqa: ASYNC110
            assert proc.poll() is None
        os.kill(victim["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    run = Run(None, run_dir)
    restarts = [e for e in run.events if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["step"] == 4, restarts
    want = {e["step"]: e for e in pools[2].train(*KILLED).steps}
    got = {e["step"]: e for e in run.steps}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5), step


def _peak_saved_rank(rank: int, world: int) -> dict:
    """The most bytes this pipeline rank's saved tensors (what autograd keeps for backward, as
    `saved_tensors_hooks` sees them: parameters and the rotary table left out) hold at once
    during one real 1f1b step of 4 micro-batches at pp 2 (eager fp32, seq 1024: activations
    dominate), beside what `fsdprun plan` counts for this rank."""
    import weakref

    import torch
    from torch import nn

    from fsdprun.data import Batch
    from fsdprun.data.prefetch import StepBatches
    from fsdprun.device import build_worker_device
    from fsdprun.tools.plan import plan_memory
    from fsdprun.train import worker
    from fsdprun.train.loop import forward_backward

    seq = 1024
    # Two blocks a stage and a vocabulary of 64: the blocks dominate the last stage too (plan's
    # eager loss counts 12 bytes a logit, an fp32 copy that fp32 logits do not make: 4 measured).
    over = ["launch.nproc_per_node=2", "parallel.pp=2", f"train.seq_len={seq}",
            f"model.max_seq_len={seq}", "model.n_kv_heads=4", "model.n_layers=4",
            "model.vocab_size=64", "train.micro_batch_size=1",
            "train.global_batch_size=4"]  # fmt: skip
    cfg = load_recipe("debug", over).config
    device = build_worker_device("cpu", rank)
    trainable, _ = worker._build(cfg, worker.Ranks(rank, rank, world), device)
    engine = trainable.engine
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (1, seq + 1), generator=gen) for _ in range(4)]
    batches = StepBatches([Batch(r[:, :-1], r[:, 1:]) for r in rows], device.torch_device)
    rope = engine.inner.rope.untyped_storage().data_ptr()
    live: dict[int, list[int]] = {}  # storage -> [bytes, holders]
    now, peak = [0], [0]

    class Held:
        def __init__(self, t):
            self.t = t

    def release(ptr: int) -> None:
        live[ptr][1] -= 1
        if live[ptr][1] == 0:
            now[0] -= live.pop(ptr)[0]

    def pack(t):
        storage = t.untyped_storage()
        if isinstance(t, nn.Parameter) or storage.data_ptr() == rope:
            return t
        entry = live.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
        if entry[1] == 0:
            now[0] += entry[0]
            peak[0] = max(peak[0], now[0])
        entry[1] += 1
        held = Held(t)
        weakref.finalize(held, release, storage.data_ptr())
        return held

    def unpack(h):
        return h.t if isinstance(h, Held) else h

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        forward_backward(engine, trainable.optimizer, None, batches, num_targets=4 * seq,
                         world_size=1, grad_clip=0.0, device=device.torch_device)  # fmt: skip
    plan = plan_memory(cfg).pipeline["ranks"][rank]
    return {"measured": peak[0], "plan": plan["memory"]["activations"],
            "in_flight": plan["in_flight"]}  # fmt: skip


def test_plan_counts_each_pipeline_ranks_activations(pools):
    """Under 1f1b the first stage holds pp micro-batches' activations and the last one (with its
    logits): the most bytes each rank's saved tensors hold during a real step are within 10% of
    what `fsdprun plan` counts for that pipeline rank."""
    first, last = pools[2].submit(_peak_saved_rank)
    assert first["in_flight"] == 2 and last["in_flight"] == 1
    for rank in (first, last):
        assert rank["measured"] == pytest.approx(rank["plan"], rel=0.1), (first, last)


LLAMA_405B = ("model.dim=16384", "model.n_layers=126", "model.n_heads=128", "model.n_kv_heads=8",
              "model.ffn_dim=53248")  # fmt: skip


@pytest.mark.parametrize("shape", [(), LLAMA_405B], ids=["llama-70b", "405b"])
def test_plan_puts_pp_beside_tp_and_cp_on_64_ranks(shape):
    """`fsdprun plan llama-70b --world-size 64` (and the 405B shape) shows each pp degree beside
    tp and cp: its mesh, its largest pipeline rank's total and the schedule's bubble, which
    grows with pp at a fixed global batch (fewer micro-batches per data-parallel rank, more
    stages); FSDP still shards each stage over its ranks, so a rank holds about the model's
    state / world whatever pp. At pp 4 x tp 8 it shows each pipeline rank, the first with the
    embedding and pp micro-batches in flight, the last with the head and one, and the 1f1b
    bubble (pp - 1) / (micro-batches + pp - 1)."""
    from fsdprun.tools.plan import plan_recipe

    plan = plan_recipe("llama-70b", list(shape), world_size=64).to_dict()
    options = {o["pp"]: o for o in plan["pp_degrees"]}
    assert sorted(options) == [1, 2, 4, 8] and all(o["memory"] for o in options.values())
    assert options[2]["mesh"] == "[pp 2 x dp_shard 32]"
    bubbles = [options[pp]["bubble"] for pp in (1, 2, 4, 8)]
    assert bubbles == sorted(bubbles) and bubbles[0] == 0 < bubbles[1]
    state = {pp: o["memory"]["params"] for pp, o in options.items()}
    assert all(v == pytest.approx(state[1], rel=0.12) for v in state.values()), state
    eager = ["compile.enabled=false"]  # tp 8 refuses compile with full checkpointing
    plan = plan_recipe("llama-70b", [*shape, *eager, "parallel.pp=4", "parallel.tp=8"],
                       world_size=64).to_dict()  # fmt: skip
    assert plan["mesh"] == [("pp", 4), ("dp_shard", 2), ("tp", 8)]
    p = plan["pipeline"]
    micro = 64 // 2  # global / (micro 1 x dp 2)
    assert p["micro_batches"] == micro and p["bubble"] == pytest.approx(3 / (micro + 3))
    first, *_, last = p["ranks"]
    assert first["first"] and not first["last"] and first["in_flight"] == 4
    assert last["last"] and last["in_flight"] == 1
    assert sum(r["blocks"] for r in p["ranks"]) == 80 + 46 * bool(shape)


def test_compare_accepts_pp_configurations():
    from fsdprun.tools.compare import parse_configs

    configs = parse_configs("fsdp2,fsdp2:full:pp2,fsdp2:tp2:pp2")
    assert configs[1].overrides == ("fsdp.engine=fsdp2", "fsdp.sharding=full", "parallel.pp=2")
    assert configs[2].overrides == ("fsdp.engine=fsdp2", "parallel.tp=2", "parallel.pp=2")
    with pytest.raises(UserError, match=re.escape("pipeline parallel (parallel.pp) needs fsdp2")):
        parse_configs("ddp:pp2")


def test_tune_searches_pp_and_its_schedule_where_the_plan_needs_them():
    """llama-70b on 8 nodes of 8 GPUs with 40 GB each: the plan does not fit without pp, so the
    default space searches pp along the nodes and the schedule; the debug recipe fits on its
    2 ranks and searches neither."""
    from fsdprun.tools.tune.space import default_space, needs_pipeline_parallel, pp_choices

    cfg = load_recipe("llama-70b", ["launch.nnodes=8"]).config
    assert pp_choices(cfg) == ["1", "2", "4", "8"]
    assert needs_pipeline_parallel(cfg, 40 * 10**9, 0.1)
    space = {k.key: k.values for k in default_space(cfg, accelerator=True, pp=True)}
    assert space["parallel.pp"] == ("1", "2", "4", "8")
    assert space["parallel.pp_schedule"] == ("1f1b", "gpipe")
    assert not needs_pipeline_parallel(load_recipe("debug", []).config, 80 * 10**9, 0.1)
