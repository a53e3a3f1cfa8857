"""`fsdprun plan` under tensor parallel (`parallel.tp`): its per-rank parameter counts against the
shards that torch's own TP styles and `fully_shard` make of the real model (fake process group, meta
device: rank 0's `to_local()` shapes, never the plan's formulas), its activation estimate against
the tensors a tensor-parallel block saves for backward, and the tp 1/2/4/8 table of
`plan --world-size 64`. The memory of whole training steps under TP is in
tests/test_memory_contract.py."""

from __future__ import annotations

import gc
import json

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from fsdprun.cli import app
from fsdprun.config import load_recipe
from fsdprun.config.layout import Layout
from fsdprun.engines.activations import block_activation_bytes
from fsdprun.engines.fsdp2 import apply_fsdp
from fsdprun.engines.mesh import build_device_mesh, dp_mesh, tp_mesh
from fsdprun.engines.tp import apply_tp
from fsdprun.models import model_spec
from fsdprun.models.llama import Transformer, build_model_args, rope_table
from fsdprun.models.lora import apply_lora
from fsdprun.tools.plan import plan_memory

runner = CliRunner()

# Dims every TP degree up to 8 divides, none of the data-parallel sizes do (FSDP pads them):
# 24 heads of 4, 8 kv heads, ffn 200 (25 per TP rank at tp 8), vocab 264 (33).
SHAPE = ["model.dim=96", "model.n_heads=24", "model.n_kv_heads=8", "model.ffn_dim=200",
         "model.vocab_size=264", "model.n_layers=2", "train.seq_len=16"]  # fmt: skip


def _fake_group(world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _local_bytes(cfg) -> dict[str, int]:
    """Rank 0's fp32 shard bytes of every parameter after LoRA, apply_tp and fully_shard, as
    torch placed them on a fake group of the recipe's world size."""
    world = cfg.world_size
    _fake_group(world)
    try:
        mesh = build_device_mesh(Layout.of(cfg, world), "cpu")
        with torch.device("meta"):
            model = model_spec(cfg.model).build(cfg.model)
        apply_lora(model, cfg=cfg.lora)  # as the worker does; nothing without lora.rank
        if cfg.parallel.tp > 1:
            apply_tp(model, tp_mesh=tp_mesh(mesh), plan=model_spec(cfg.model).tp_plan(cfg.model))
            mesh = dp_mesh(mesh)
        apply_fsdp(
            model, mesh=mesh, cfg=cfg.fsdp, param_dtype=cfg.precision.param_dtype,
            reduce_dtype=cfg.precision.reduce_dtype, pin_memory=False,
        )  # fmt: skip
        local = {n: 4 * p.to_local().numel() for n, p in model.named_parameters()}
        placements = {n: str(p.placements) for n, p in model.named_parameters()}
        del model, mesh
        gc.collect()
    finally:
        dist.destroy_process_group()
    return {"bytes": local, "placements": placements}


@pytest.mark.parametrize(
    ("world", "tp", "sharding"),
    [(8, 2, "full"), (8, 4, "hybrid"), (64, 8, "full"), (64, 2, "hybrid"), (64, 8, "grad_op")],
)
def test_plan_counts_the_shards_torch_makes(world, tp, sharding):
    cfg = load_recipe(
        "debug", [*SHAPE, f"launch.nproc_per_node={min(world, 8)}",
                  f"launch.nnodes={max(world // 8, 1)}", "launch.rdzv_endpoint=h:1",
                  f"train.global_batch_size={world}", "train.micro_batch_size=1",
                  f"parallel.tp={tp}", f"fsdp.sharding={sharding}"],
    ).config  # fmt: skip
    plan = plan_memory(cfg)
    measured = _local_bytes(cfg)
    s = plan.strategies[plan.recipe_strategy]
    assert s.params == sum(measured["bytes"].values())
    # Not the same total by luck: the norms are whole on every TP rank (only FSDP shards them)
    # and every matmul weight is cut by tp too.
    dp_shard = dict(plan.mesh)["dp_shard"]
    assert measured["bytes"]["norm.weight"] == 4 * -(-96 // dp_shard)
    assert "Replicate()" in measured["placements"]["norm.weight"]
    assert (
        measured["bytes"]["layers.0.feed_forward.w1.weight"] == 4 * -(-200 // tp // dp_shard) * 96
    )
    assert measured["bytes"]["layers.0.feed_forward.w2.weight"] == 4 * -(-96 // dp_shard) * (
        200 // tp
    )
    # AdamW: two fp32 moments per element of the shard, a 4-byte step per tensor; no more.
    assert s.optimizer == 2 * s.params + 4 * len(measured["bytes"])
    # FSDP gathers over the dp dims only: a block's gathered copy is 1/tp of the whole block
    # (its norms whole), in param_dtype (this recipe's: fp32), padded to the shard group.
    block = [u for u in plan.units if u.path == "layers.0"][0]
    dims = block_dims(cfg.model)
    gathered = sum(-(-rows // dp_shard) * dp_shard * cols for rows, cols in _local_rows(dims, tp))
    assert cfg.precision.param_dtype.value == "fp32" and block.unsharded_bytes == 4 * gathered


def test_plan_counts_the_shards_of_experts_and_adapters_torch_makes(tmp_path):
    """A mixture of experts (Qwen3-MoE: 4 experts split 2 a TP rank, then by FSDP over dp_shard
    4; the router replicated) and LoRA adapters (A whole and B split under column-wise layers,
    A split and B whole under row-wise ones) at tp 2 on 8 ranks: the plan's parameter bytes are
    those of the shards torch makes (fake group, meta device)."""
    from hf_families import save_tiny_hf

    moe = save_tiny_hf("qwen3_moe", tmp_path / "moe")
    eight = ["launch.nproc_per_node=8", "train.global_batch_size=8", "train.micro_batch_size=1",
             "parallel.tp=2"]  # fmt: skip
    cases = {
        "moe": [*eight, f"model.hf_path={moe}"],
        "lora": [*eight, *SHAPE, "lora.rank=8", "lora.targets=[attention,mlp]"],
    }
    for name, overrides in cases.items():
        cfg = load_recipe("debug", overrides).config
        plan = plan_memory(cfg)
        measured = _local_bytes(cfg)
        assert plan.strategies[plan.recipe_strategy].params == sum(measured["bytes"].values())
        got = measured["bytes"]
        if name == "moe":
            # [4 experts, 2 x 32, 64]: 2 experts a TP rank; FSDP's dim-0 shard of those over
            # dp_shard 4 leaves rank 0 one expert (the others pad).
            assert got["hf.model.layers.0.mlp.experts.gate_up_proj"] == 4 * 1 * 64 * 64
            assert "Replicate()" in measured["placements"]["hf.model.layers.0.mlp.gate.weight"]
        else:
            # wq's B (96 x 8) by rows over tp, then dp_shard 4; wo's A (8 x 96) by columns.
            assert got["layers.0.attention.wq.lora_B.weight"] == 4 * 96 // 2 // 4 * 8
            assert got["layers.0.attention.wo.lora_A.weight"] == 4 * -(-8 // 4) * 96 // 2


def block_dims(m) -> dict[str, int]:
    return {"dim": m.dim, "q": m.dim, "kv": m.dim // m.n_heads * m.n_kv_heads, "ffn": m.ffn_dim}


def _local_rows(d: dict[str, int], tp: int) -> list[tuple[int, int]]:
    """(dim 0, the rest) of each of a block's parameters on one TP rank."""
    return [
        (d["dim"], 1),
        (d["dim"], 1),  # the two norms: whole
        (d["q"] // tp, d["dim"]),
        (d["kv"] // tp, d["dim"]),
        (d["kv"] // tp, d["dim"]),  # wq wk wv
        (d["dim"], d["q"] // tp),  # wo: row-wise
        (d["ffn"] // tp, d["dim"]),
        (d["ffn"] // tp, d["dim"]),  # w1 w3
        (d["dim"], d["ffn"] // tp),  # w2: row-wise
    ]


def test_tp_block_saves_what_the_activation_formula_says():
    # A tensor-parallel block (tp 4 on a fake group): the tensors autograd keeps for backward,
    # read from their local shards, against block_activation_bytes (sequence parallel).
    tp = 4
    cfg = load_recipe(
        "debug", [*SHAPE, "launch.nproc_per_node=4", "train.global_batch_size=2",
                  "train.micro_batch_size=2", "train.seq_len=48", f"parallel.tp={tp}",
                  "precision.param_dtype=bf16"],
    ).config  # fmt: skip
    from torch.distributed.tensor import DTensor

    args = build_model_args(cfg.model)
    _fake_group(tp)
    try:
        mesh = build_device_mesh(Layout.of(cfg, tp), "cpu")
        model = Transformer(args).to(torch.bfloat16)
        apply_tp(model, tp_mesh=tp_mesh(mesh), plan=model_spec(cfg.model).tp_plan(cfg.model))
        params = {
            (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            for p in model.parameters()
        }
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            if storage.data_ptr() not in params and local.numel() >= 2 * 48:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        # Between blocks the activations are sharded on the sequence: this rank's 48 / tp.
        x = torch.randn(2, 48 // tp, args.dim, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.layers["0"](x, rope_table(args))
        del model, mesh
        gc.collect()
    finally:
        dist.destroy_process_group()
    assert sum(saved.values()) == pytest.approx(block_activation_bytes(cfg), rel=0.03)


def test_plan_at_64_ranks_shows_tp_1_2_4_8_side_by_side():
    # Eager (the recipe compiles; TP with compile and checkpointing is refused, so the tp>1
    # columns of the recipe as shipped are eager: compared below) so every column counts alike.
    result = runner.invoke(
        app,
        ["plan", "llama-70b", "compile.enabled=false", "--world-size", "64", "--json"],
        env={"COLUMNS": "160"},
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    options = {o["tp"]: o for o in doc["tp_degrees"]}
    assert sorted(options) == [1, 2, 4, 8] and not any(o["missing"] for o in options.values())
    assert [options[t]["mesh"] for t in (1, 2, 4, 8)] == [
        "[dp 64]", "[dp_shard 32 x tp 2]", "[dp_shard 16 x tp 4]", "[dp_shard 8 x tp 8]",
    ]  # fmt: skip
    mem = {t: o["memory"] for t, o in options.items()}
    # The model state divides over dp x tp = 64 whatever tp is (the norms, 0.002% of 70B, are
    # the only difference); gathered buffers and activations divide by tp.
    for t in (2, 4, 8):
        assert mem[t]["params"] == pytest.approx(mem[1]["params"], rel=0.001)
        assert mem[t]["gathered_buffers"] == pytest.approx(mem[1]["gathered_buffers"] / t, rel=0.01)
        assert mem[t]["activations"] < mem[1]["activations"] / t * 1.5
    assert mem[1] == doc["strategies"]["full"]
    table = runner.invoke(app, ["plan", "llama-70b", "--world-size", "64"], env={"COLUMNS": "160"})
    out = table.output
    assert "Tensor parallel at world size 64" in out and "tp 1 (recipe)" in out
    assert "[dp_shard 8 x tp 8]" in out and "mesh [dp 64]" in out
    # The shipped recipe compiles with full checkpointing, which TP refuses: its tp columns
    # are the eager run, and say so.
    assert "tp 8 [dp_shard 8 x tp 8]" in out and "(compile off)" in out
    assert "tp 1 (recipe) [dp 64]" in out and "[dp 64] 41.50 GiB (compile off)" not in out


def test_plan_says_why_a_tp_degree_is_missing():
    # 6 heads and 2 kv heads: tp 4 and 8 divide neither; 2 ranks per node: tp 4 and 8 span nodes.
    result = runner.invoke(
        app, ["plan", "debug", "model.n_heads=6", "model.dim=96", "model.n_kv_heads=2",
              "train.global_batch_size=16", "--world-size", "8", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    options = {o["tp"]: o for o in json.loads(result.output)["tp_degrees"]}
    assert options[2]["missing"] is None and options[2]["memory"]["params"] > 0
    assert "model.n_kv_heads (2)" in options[4]["missing"]
    assert "model.n_heads (6)" in options[4]["missing"]
    two = runner.invoke(
        app, ["plan", "debug", "launch.nproc_per_node=2", "train.global_batch_size=16",
              "--world-size", "8"],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    out = " ".join(two.output.split())
    assert "tp 4: not possible, parallel.tp (4) exceeds launch.nproc_per_node (2)" in out


def test_recipe_at_tp_shows_its_mesh_and_no_ddp_column():
    result = runner.invoke(
        app, ["plan", "llama-70b", "parallel.tp=8", "compile.enabled=false", "fsdp.sharding=hybrid",
              "fsdp.shard_group_size=2", "--world-size", "64", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["mesh"] == [["dp_replicate", 4], ["dp_shard", 2], ["tp", 8]]
    assert "ddp" not in doc["strategies"] and doc["recipe_strategy"] == "hybrid"
    assert doc["strategies"]["hybrid"]["shard_group"] == 2
    # 16 B per parameter over dp_shard 2 x tp 8 (the norms over 2 only)
    state = sum(doc["strategies"]["hybrid"][k] for k in ("params", "grads", "optimizer"))
    assert state == pytest.approx(16 * doc["num_params"] / 16, rel=0.005)
    assert any("tensor parallel 8" in n for n in doc["notes"])


def test_hf_folder_activations_divide_by_tp_like_the_built_in_llama(tmp_path):
    # The HF plan has sequence parallel too: an HF folder's block at tp 2 is estimated as the
    # built-in Llama's of the same shape (seq / tp tokens between blocks and in the norms).
    import dataclasses

    from conftest import save_tiny_hf_llama

    folder = save_tiny_hf_llama(tmp_path / "tiny-llama")
    over = ["launch.nproc_per_node=2", "parallel.tp=2", "train.seq_len=32"]
    hf = load_recipe("debug", [*over, f"model.hf_path={folder}"]).config
    hf = dataclasses.replace(hf, model=model_spec(hf.model).shape(hf.model))
    shape = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
             "model.vocab_size=256", "model.n_layers=2"]  # fmt: skip
    llama = load_recipe("debug", [*over, *shape]).config
    one = load_recipe("debug", ["train.seq_len=32", f"model.hf_path={folder}"]).config
    one = dataclasses.replace(one, model=model_spec(one.model).shape(one.model))
    assert block_activation_bytes(hf) == block_activation_bytes(llama)
    assert block_activation_bytes(hf) < block_activation_bytes(one) / 1.5
