"""`fsdprun inspect-checkpoint` and `fsdprun export` on real checkpoints.

One real 2-rank training run (the `fsdprun` command as a subprocess, once for the module) gives
the checkpoints; the commands under test run in-process through typer's CliRunner. Exports are
compared with DCP's own `dcp_to_torch_save` of the same checkpoint.
Run with `pytest tests/test_inspect_export.py`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_fsdprun
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from typer.testing import CliRunner

from fsdprun.checkpoint.dcp_metadata import DType, read_metadata
from fsdprun.checkpoint.dcp_metadata import TensorStorageMetadata as LightTensorMetadata
from fsdprun.checkpoint.export import exported_tensors, safetensors_header, split_shards
from fsdprun.checkpoint.manifest import manifest_problem
from fsdprun.cli import app
from fsdprun.config import parse_size

runner = CliRunner()


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    monkeypatch.delenv("FSDPRUN_DEBUG", raising=False)  # errors stay one line
    monkeypatch.setenv("COLUMNS", "200")  # no folded table cells


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real 2-rank run of the debug recipe that saved steps 2 and 4."""
    root = tmp_path_factory.mktemp("ckpt_run")
    args = ["train.steps=4", "checkpoint.every_steps=2", "--run-dir", str(root / "run")]
    proc = run_fsdprun("train", "debug", *args, cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="module")
def ckpt(run_dir) -> Path:
    return run_dir / "checkpoints" / "step-00000004"


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The full model tensors as DCP itself consolidates them."""
    file = tmp_path_factory.mktemp("ref") / "full.pt"
    dcp_to_torch_save(ckpt, file)
    return torch.load(file, weights_only=True)["model"]


@pytest.fixture(scope="module")
def other_ckpt(ckpt, reference, tmp_path_factory) -> Path:
    """A one-process DCP save of the model with known differences: layer 1 gone, a new tensor,
    the embedding narrower, the final norm in bf16 (a real training run would cost ~14 s)."""
    model = {k: t for k, t in reference.items() if not k.startswith("layers.1.")}
    model["tok_embeddings.weight"] = model["tok_embeddings.weight"][:, :32].clone()
    model["norm.weight"] = model["norm.weight"].to(torch.bfloat16)
    model["extra.weight"] = torch.zeros(3)
    path = tmp_path_factory.mktemp("other") / "step-00000004"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model}, checkpoint_id=path, no_dist=True)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.pop("sha256", None)
    manifest.update(world_size=1, files={p.name: p.stat().st_size for p in path.iterdir()})
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def invoke(*args: str | Path):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, code: int) -> str:
    assert result.exit_code == code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def corrupt_copy(ckpt: Path, tmp_path: Path, damage: str) -> Path:
    copy = Path(shutil.copytree(ckpt, tmp_path / ckpt.name))
    if damage == "truncate":
        shard = copy / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        (copy / damage).unlink()
    return copy


# --------------------------------------------------------------------------------------------
# inspect-checkpoint


def test_inspect_shows_the_checkpoint(ckpt):
    result = invoke("inspect-checkpoint", ckpt)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "complete" in out and "step 4 on 2 ranks" in out
    assert re.search(r"^mesh +2 dp *$", out, re.MULTILINE), out  # fsdp2 full: 1-D
    assert "llama: dim 64, 2 layers" in out and "global batch 8 × seq 64" in out
    assert "optimizer" in out and "referenced by .metadata" in out
    # A summary by default: the tensors are counted, and listed with --full.
    doc = json.loads(invoke("inspect-checkpoint", ckpt, "--json").stdout)
    total = sum(g["tensors"] for g in doc["groups"].values())
    assert total > 20 and "model.layers.0.attention.wq.weight" not in out
    assert out.rstrip().splitlines()[-1] == (
        f"{total} tensors; --full lists them all, --tensors GLOB those matching "
        "(e.g. 'model.layers.0.*')"
    )
    full = invoke("inspect-checkpoint", ckpt, "--full")
    assert full.exit_code == 0 and full.stdout.startswith(out.rsplit("\n", 2)[0])
    out = full.stdout
    assert f"Tensors ({total} of {total})" in out
    row = next(line for line in out.splitlines() if "model.layers.0.attention.wq.weight" in line)
    cells = [cell.strip() for cell in row.split("│")]
    assert cells[1:6] == [
        "model.layers.0.attention.wq.weight",
        "64×64",
        "float32",
        "16.00 KiB",
        "2",
    ]


def test_a_manifest_without_a_mesh_still_reads_and_a_malformed_one_is_corrupt(ckpt, tmp_path):
    copy = Path(shutil.copytree(ckpt, tmp_path / ckpt.name))
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["mesh"]  # written before fsdprun recorded it
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = invoke("inspect-checkpoint", copy)
    assert result.exit_code == 0 and "step 4 on 2 ranks" in result.stdout, result.output
    assert not re.search(r"^mesh ", result.stdout, re.MULTILINE)
    assert manifest_problem(manifest) is None
    for mesh in ({"shape": [2, 2], "dim_names": ["dp"]}, {"shape": [0], "dim_names": ["dp"]},
                 {"shape": 2, "dim_names": "dp"}, {"dim_names": ["dp"]}):  # fmt: skip
        assert "'mesh' must hold" in manifest_problem({**manifest, "mesh": mesh}), mesh


def test_inspect_json_counts_and_bytes(ckpt, reference):
    result = invoke("inspect-checkpoint", ckpt, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    tensors = [k for k, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)]  # fmt: skip
    assert doc["kind"] == "checkpoint" and doc["complete"] is True
    assert doc["step"] == 4 and doc["world_size"] == 2
    assert doc["mesh"] == {"shape": [2], "dim_names": ["dp"]}
    assert len(doc["tensors"]) == len(tensors)
    assert sum(g["tensors"] for g in doc["groups"].values()) == len(tensors)
    assert doc["groups"]["model"]["tensors"] == len(reference)
    assert doc["groups"]["model"]["bytes"] == sum(t.nbytes for t in reference.values())
    assert doc["groups"]["optimizer"]["tensors"] == 3 * len(reference)  # exp_avg(_sq), step
    assert doc["groups"]["other"]["tensors"] == 3  # train_state, rng.rank0, rng.rank1
    assert doc["num_params"] == sum(t.numel() for t in reference.values())
    on_disk = sum(p.stat().st_size for p in ckpt.iterdir())
    assert doc["bytes_referenced"] <= doc["bytes_on_disk"] == on_disk
    assert doc["recipe"]["model"]["dim"] == 64 and doc["recipe"]["global_batch_size"] == 8


def test_inspect_tensors_filter(ckpt):
    result = invoke("inspect-checkpoint", ckpt, "--tensors", "model.layers.1.*", "--json")
    names = [t["name"] for t in json.loads(result.stdout)["tensors"]]
    assert len(names) == 9 and all(n.startswith("model.layers.1.") for n in names)
    table = invoke("inspect-checkpoint", ckpt, "--tensors", "*.wq.weight*").stdout
    # 2 layers × (weight, exp_avg, exp_avg_sq, step)
    assert "Tensors matching '*.wq.weight*' (8 of " in table
    assert "model.layers.1.attention.wq.weight" in table and "wk.weight" not in table


def test_inspect_diff(ckpt, other_ckpt):
    args = ["inspect-checkpoint", ckpt, "--diff", other_ckpt, "--tensors", "model.*"]
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    diff = json.loads(result.stdout)["diff"]
    assert [e["name"] for e in diff["added"]] == ["model.extra.weight"]
    assert {e["name"] for e in diff["removed"]} == {
        f"model.layers.1.{n}.weight"
        for n in ("attention_norm", "ffn_norm", "attention.wq", "attention.wk", "attention.wv",
                  "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    }  # fmt: skip
    assert diff["changed"] == [
        {"name": "model.norm.weight", "from": {"dtype": "float32", "shape": [64]},
         "to": {"dtype": "bfloat16", "shape": [64]}},
        {"name": "model.tok_embeddings.weight", "from": {"dtype": "float32", "shape": [256, 64]},
         "to": {"dtype": "float32", "shape": [256, 32]}},
    ]  # fmt: skip
    table = invoke(*args).stdout
    assert "1 added, 9 removed, 2 changed" in table
    row = next(line for line in table.splitlines() if "model.tok_embeddings.weight" in line)
    assert "changed" in row and "256×64 float32" in row and "256×32 float32" in row
    # Steps 2 and 4 of one run hold the same tensors: the train_state JSON's byte length is no
    # difference; its numbers are, and are named as such.
    step2 = ckpt.parent / "step-00000002"
    same = json.loads(invoke("inspect-checkpoint", ckpt, "--diff", step2, "--json").stdout)
    assert same["diff"]["added"] == same["diff"]["removed"] == same["diff"]["changed"] == []
    state = {e["key"]: (e["from"], e["to"]) for e in same["diff"]["train_state"]}
    assert state["step"] == (4, 2) and "world_size" not in state
    same = invoke("inspect-checkpoint", ckpt, "--diff", step2)
    assert same.exit_code == 0 and "no differences in tensor names" in same.stdout
    assert "train_state" not in same.stdout and "train state: " in same.stdout
    assert "step 4 -> 2" in same.stdout


def test_inspect_run_dir_lists_checkpoints(run_dir, tmp_path):
    for target in (run_dir, run_dir / "checkpoints"):
        result = invoke("inspect-checkpoint", target)
        assert result.exit_code == 0, result.output
        rows = [line for line in result.stdout.splitlines() if "step-0000000" in line]
        assert len(rows) == 2 and all("complete" in row for row in rows)
    run = Path(shutil.copytree(run_dir, tmp_path / "run"))
    (run / "checkpoints" / "step-00000002" / "__1_0.distcp").unlink()
    result = invoke("inspect-checkpoint", run, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert [(c["step"], c["complete"]) for c in doc["checkpoints"]] == [(2, False), (4, True)]
    assert "__1_0.distcp is missing" in doc["checkpoints"][0]["reason"]
    assert "step-00000002: shard file __1_0.distcp is missing" in one_line_error(result, 1)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (".metadata", "no .metadata"),
        ("__1_0.distcp", "shard file __1_0.distcp is missing"),
        ("truncate", "shard file __0_0.distcp is truncated"),
        ("manifest.json", "no manifest.json"),
    ],
)
def test_inspect_incomplete_checkpoint_exits_1(ckpt, tmp_path, damage, message):
    copy = corrupt_copy(ckpt, tmp_path, damage)
    result = invoke("inspect-checkpoint", copy)
    assert message in one_line_error(result, 1)
    assert result.stdout == ""
    doc = json.loads(invoke("inspect-checkpoint", copy, "--json").stdout)
    assert doc["complete"] is False and message in doc["reason"]


def test_inspect_not_a_checkpoint_exits_2(tmp_path):
    (tmp_path / "random.bin").write_bytes(b"\x00" * 100)
    (tmp_path / "empty").mkdir()
    assert "a file, not a checkpoint" in one_line_error(
        invoke("inspect-checkpoint", tmp_path / "random.bin"), 2
    )
    assert "not a checkpoint" in one_line_error(invoke("inspect-checkpoint", tmp_path / "empty"), 2)
    assert "no such file" in one_line_error(invoke("inspect-checkpoint", tmp_path / "nope"), 2)


def test_dcp_metadata_reader_reads_what_dcp_reads(ckpt):
    """fsdprun's torch-free reader of `.metadata` gives DCP's own keys, shapes, dtypes, chunks
    and storage records."""
    light = read_metadata(ckpt)
    real = FileSystemReader(str(ckpt)).read_metadata()
    assert list(light.state_dict_metadata) == list(real.state_dict_metadata)
    for key, md in real.state_dict_metadata.items():
        ours = light.state_dict_metadata[key]
        assert isinstance(ours, LightTensorMetadata) == isinstance(md, TensorStorageMetadata)
        if isinstance(md, TensorStorageMetadata):
            assert ours.size == tuple(md.size), key
            assert str(ours.properties.dtype) == str(md.properties.dtype), key
            assert ours.properties.dtype.itemsize == md.properties.dtype.itemsize, key
            assert [(c.offsets, c.sizes) for c in ours.chunks] == [
                (tuple(c.offsets), tuple(c.sizes)) for c in md.chunks
            ], key

    def storage(metadata):
        return sorted((i.relative_path, i.offset, i.length) for i in metadata.storage_data.values())

    assert storage(light) == storage(real)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8,
                  torch.bool, torch.float8_e4m3fn, torch.complex64, torch.float64):  # fmt: skip
        assert DType(str(dtype).removeprefix("torch.")).itemsize == dtype.itemsize


class _Payload:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize(
    "payload", [(os.system, "touch {mark}"), (exec, "open({mark!r}, 'w').close()")]
)
def test_a_tampered_metadata_runs_no_code(ckpt, tmp_path, payload):
    """`.metadata` is a pickle; inspect reads it without running what it names."""
    copy = shutil.copytree(ckpt, tmp_path / "ckpt")
    mark = tmp_path / "ran"
    func, arg = payload
    (copy / ".metadata").write_bytes(pickle.dumps(_Payload(func, arg.format(mark=str(mark)))))
    assert ".metadata unreadable (MetadataError)" in one_line_error(
        invoke("inspect-checkpoint", copy), 1
    )
    assert not mark.exists()


# --------------------------------------------------------------------------------------------
# export


def test_export_safetensors_equals_dcp_consolidation(ckpt, reference, tmp_path):
    result = invoke("export", ckpt, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], tensor), name
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["step"] == "4"


def test_export_sharded_safetensors_with_index(ckpt, reference, tmp_path):
    out = tmp_path / "out"
    result = invoke("export", ckpt, "--out", out, "--max-shard-size", "40KB")
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.iterdir()) == [*files, "model.safetensors.index.json"]
    assert index["weight_map"].keys() == reference.keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in reference.values())
    for file in files:
        for name, tensor in load_file(out / file).items():
            assert index["weight_map"][name] == file
            assert torch.equal(tensor, reference[name]), name


def test_export_bf16_into_an_empty_folder(ckpt, reference, tmp_path):
    (tmp_path / "out").mkdir()
    result = invoke("export", ckpt, "--out", tmp_path / "out", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    exported = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in reference.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name


def test_export_torch_format(ckpt, reference, tmp_path):
    assert invoke("export", ckpt, "--out", tmp_path / "one", "--format", "torch").exit_code == 0
    exported = torch.load(tmp_path / "one" / "pytorch_model.bin", weights_only=True)
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], t) for k, t in reference.items())
    out = tmp_path / "sharded"
    result = invoke("export", ckpt, "--out", out, "--format", "torch", "--max-shard-size", "100KB")
    assert result.exit_code == 0, result.output
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    merged = {}
    for file in sorted(set(index["weight_map"].values())):
        merged.update(torch.load(out / file, weights_only=True))
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], t) for k, t in reference.items())


def test_export_refuses_existing_out(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "already exists" in one_line_error(invoke("export", ckpt, "--out", out), 2)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"


def test_export_refuses_incomplete_checkpoint(ckpt, tmp_path):
    copy = corrupt_copy(ckpt, tmp_path, "__1_0.distcp")
    line = one_line_error(invoke("export", copy, "--out", tmp_path / "out"), 2)
    assert "not a complete checkpoint" in line and "__1_0.distcp is missing" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flag", "value"), [("--dtype", "fp16"), ("--format", "onnx"), ("--max-shard-size", "5XB")]
)
def test_export_rejects_bad_options(ckpt, tmp_path, flag, value):
    result = invoke("export", ckpt, "--out", tmp_path / "out", flag, value)
    assert flag in one_line_error(result, 2)
    assert not (tmp_path / "out").exists()


def test_sizes_shards_and_header(ckpt):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000 and parse_size("1.5MB") == 1_500_000
    plans, skipped = exported_tensors(FileSystemReader(str(ckpt)).read_metadata(), dtype=None)
    assert skipped == [] and plans[0].name == "tok_embeddings.weight"
    shards = split_shards(plans, 40_000)
    assert [p for shard in shards for p in shard] == plans
    assert all(sum(p.num_bytes for p in s) <= 40_000 or len(s) == 1 for s in shards)
    header = safetensors_header(plans, {"format": "pt"})
    length = int.from_bytes(header[:8], "little")
    assert len(header) == 8 + length and length % 8 == 0
    assert json.loads(header[8:])["norm.weight"]["dtype"] == "F32"


def test_tied_embeddings_are_counted_once(fsdprun_runs, tmp_path):
    # The checkpoint stores the tied tensor under both names; training counts it once and so must
    # inspect and export. Same run as tests/test_engines.py's tied test (cached per session).
    run = fsdprun_runs.train(
        "fsdp.engine=fsdp2", "model.tie_embeddings=true", "train.steps=5", "output.log_every=1"
    ).check()
    ckpt = run.run_dir / "checkpoints" / "step-00000005"
    trained = run.start["num_params"]
    assert trained == 115_008
    tie = {"model.output.weight": "model.tok_embeddings.weight"}
    doc = json.loads(invoke("inspect-checkpoint", ckpt, "--json").stdout)
    assert doc["num_params"] == trained and doc["tied"] == tie
    assert doc["groups"]["model"]["tensors"] == 21  # both names are still there
    text = " ".join(invoke("inspect-checkpoint", ckpt).stdout.split())
    assert "115.01K params (model.output.weight tied to model.tok_embeddings.weight)" in text
    result = invoke("export", ckpt, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "exported 21 tensors (115.01K params," in " ".join(result.stdout.split())
    # A checkpoint whose manifest predates the record: the recipe's tie_embeddings says it.
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["train_state"]["tied_params"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    doc = json.loads(invoke("inspect-checkpoint", old, "--json").stdout)
    assert doc["num_params"] == trained and doc["tied"] == tie
