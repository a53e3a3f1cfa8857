"""Tensor parallelism (`parallel.tp`, docs/tensor-parallel.md): the refusals before launch, the
mesh rules, and (in real gloo processes) the promise that tp x dp trains exactly as plain FSDP2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fsdprun.launch.elastic
from fsdprun.cli import app
from fsdprun.config import load_recipe
from fsdprun.engines.mesh import dp_rank, dp_size, mesh_dims, shard_group_size
from fsdprun.errors import UserError

FOUR = ["launch.nproc_per_node=4"]


def errors_of(*overrides: str, recipe: str = "debug") -> list[str]:
    """Every problem `load_recipe` reports (each on its own line of the one error)."""
    with pytest.raises(UserError) as info:
        load_recipe(recipe, list(overrides))
    return str(info.value).splitlines()


def one_error(*overrides: str) -> str:
    errors = [e for e in errors_of(*overrides) if "parallel.tp" in e]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize(
    ("overrides", "phrase"),
    [
        (["model.n_heads=8", "model.n_kv_heads=1"], "model's model.n_kv_heads (1)"),
        (["model.n_heads=2", "model.n_kv_heads=2", "parallel.tp=4"], "model's model.n_heads (2)"),
        (["model.ffn_dim=191"], "model's model.ffn_dim (191)"),
        (["model.vocab_size=255"], "model's model.vocab_size (255)"),
        (["train.seq_len=63"], "does not divide train.seq_len (63)"),
        (["fsdp.engine=fsdp1"], "fsdp.engine=fsdp1 cannot shard DTensor"),
        (["fsdp.engine=ddp"], "fsdp.engine=ddp cannot shard DTensor"),
        (["lora.rank=4"], "lora.rank=4: LoRA's adapted layers"),
        (["train.loss=chunked"], "train.loss=chunked"),
        (["model.tie_embeddings=true"], "tied embeddings"),
        (["compile.enabled=true", "compile.per_block=false"], "compile.per_block=false"),
        (["fsdp.cpu_offload=true"], "fsdp.cpu_offload=true"),
        (["parallel.tp=8", "launch.nproc_per_node=8"], "model's model.n_kv_heads (2)"),
        (["parallel.tp=4", "launch.nproc_per_node=6", "launch.nnodes=2",
          "launch.rdzv_endpoint=h:1", "train.global_batch_size=24", "model.n_kv_heads=4"],
         "must divide launch.nproc_per_node (6), so that no TP group straddles two nodes"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(overrides, phrase):
    tp = [o for o in overrides if o.startswith("parallel.tp=")] or ["parallel.tp=2"]
    found = [e for e in errors_of(*FOUR, *tp, *overrides) if phrase in e]
    assert len(found) == 1, errors_of(*FOUR, *tp, *overrides)


def test_tp_larger_than_a_node_is_refused_unless_forced():
    two_nodes = ["launch.nproc_per_node=2", "launch.nnodes=2", "launch.rdzv_endpoint=h:1",
                 "model.n_kv_heads=4", "parallel.tp=4"]  # fmt: skip
    message = one_error(*two_nodes)
    assert "exceeds launch.nproc_per_node (2)" in message
    assert "parallel.tp_across_nodes=true" in message
    load_recipe("debug", [*two_nodes, "parallel.tp_across_nodes=true"])


def test_tp_must_divide_the_world_and_the_batch_counts_dp_ranks():
    assert "must divide the world size (4)" in one_error(
        *FOUR, "parallel.tp=3", "parallel.tp_across_nodes=true"
    )
    # global 8 = micro 2 x dp 2 x 2 micro-steps: valid under tp2 x dp2, and micro 4 x dp 2 too
    cfg = load_recipe("debug", [*FOUR, "parallel.tp=2", "train.micro_batch_size=4"]).config
    assert cfg.dp_world_size == 2
    (batch,) = [e for e in errors_of(*FOUR, "parallel.tp=2", "train.micro_batch_size=3")
                if "global_batch_size" in e]  # fmt: skip
    assert "data-parallel ranks (2 = world size / parallel.tp)" in batch


def test_hf_folder_dims_are_read_from_its_config(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
              "vocab_size": 250, "tie_word_embeddings": True, "hidden_size": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    found = errors_of(*FOUR, "parallel.tp=4", f"model.hf_path={folder}")
    assert any("num_key_value_heads (2)" in e for e in found), found
    assert any("vocab_size (250)" in e for e in found), found
    assert any("tied embeddings" in e for e in found), found
    assert not any("intermediate_size" in e for e in found), found


def test_mesh_dims_put_tp_innermost():
    def cfg(*o):
        return load_recipe("debug", [*FOUR, *o]).config

    assert mesh_dims(cfg("parallel.tp=2")) == [("dp_shard", 2), ("tp", 2)]
    hybrid = cfg("parallel.tp=2", "fsdp.sharding=hybrid", "launch.nproc_per_node=8",
                 "train.global_batch_size=16")  # fmt: skip
    # 8 ranks on a node, tp 2: the shard group is the node's 4 data-parallel ranks.
    assert mesh_dims(hybrid, 16) == [("dp_replicate", 2), ("dp_shard", 4), ("tp", 2)]
    assert shard_group_size(hybrid, 16) == 4 and dp_size(hybrid, 16) == 8
    assert mesh_dims(cfg()) == [("dp", 4)]  # without TP: as before
    assert mesh_dims(cfg("fsdp.sharding=hybrid")) == [("replicate", 1), ("shard", 4)]
    assert [dp_rank(r, 2) for r in range(4)] == [0, 0, 1, 1]


def test_cli_refuses_before_launch_in_one_line(tmp_path, monkeypatch):
    def must_not_launch(*args, **kwargs):
        raise AssertionError("a bad input reached the launcher")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fsdprun.launch.elastic, "elastic_launch", must_not_launch)
    result = CliRunner().invoke(
        app, ["train", "debug", "parallel.tp=2", "fsdp.engine=ddp", "--run-dir", "r"]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "fsdp.engine=ddp cannot shard DTensor" in lines[0], lines
    assert not Path("r").exists()
