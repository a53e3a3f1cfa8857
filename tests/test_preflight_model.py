"""Before any worker starts: a model folder the workers could not build is refused in one line
(issue 51: remote code, an unknown model type, a truncated or missing weights file, a tensor
missing or misshapen, LoRA on a mixture of experts' MLP), and `plan` answers every layout
question as `train`'s preflight does (issue 57: one set of checks, `config.layout` and
`engines.preflight`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_fsdprun
from typer.testing import CliRunner

from fsdprun.cli import app

HF_DEMO = Path(__file__).parent.parent / "recipes" / "data" / "tiny-llama-hf"
FOUR = ["launch.nproc_per_node=4"]


def _folder(tmp_path: Path, name: str, **config) -> Path:
    """A copy of the shipped tiny Llama folder with config.json's keys replaced by `config`."""
    folder = tmp_path / name
    shutil.copytree(HF_DEMO, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _remote_code(tmp_path: Path) -> Path:
    """A folder that ships its own model code (config.json's auto_map): a Llama under another
    model_type."""
    folder = _folder(tmp_path, "remote", model_type="tinyremote", auto_map={
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
    })  # fmt: skip
    (folder / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n"
        "    model_type = 'tinyremote'\n"
    )
    (folder / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig"
        "\n\n\nclass TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
    )
    return folder


def _without_tensor(tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    folder = _folder(tmp_path, "no-tensor")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _truncated(tmp_path: Path) -> Path:
    folder = _folder(tmp_path, "truncated")
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return folder


def _no_weights(tmp_path: Path) -> Path:
    folder = _folder(tmp_path, "no-weights")
    (folder / "model.safetensors").unlink()
    return folder


BAD_FOLDERS = {
    "remote code": (_remote_code, [], "ships its own model code for model_type 'tinyremote' "
                                      "(config.json's auto_map); fsdprun runs it only with "
                                      "model.trust_remote_code=true"),
    "unknown model_type": (lambda t: _folder(t, "unknown", model_type="nosuchmodel"), [],
                           "model type `nosuchmodel` but Transformers does not recognize"),
    "truncated weights": (_truncated, [], "model.safetensors cannot be read (Error while "
                                          "deserializing header"),
    "no weights": (_no_weights, [], "has neither model.safetensors nor "
                                    "model.safetensors.index.json"),
    "shape mismatch": (lambda t: _folder(t, "shape", intermediate_size=384), [],
                       "model.layers.0.mlp.gate_proj.weight has shape (192, 64) in "
                       "model.safetensors, the model expects (384, 64)"),
    "missing tensor": (_without_tensor, [], "lacks the weights model.layers.1.mlp.down_proj"),
}  # fmt: skip


@pytest.mark.parametrize("case", [*BAD_FOLDERS, "moe lora mlp"])
def test_a_folder_the_workers_could_not_build_is_refused_before_launch(
    case, tmp_path, hf_family_dirs
):
    """`fsdprun train` refuses in one line, exit 2, before any rank starts: no traceback, no
    "rank 0 failed", no run directory left behind."""
    if case == "moe lora mlp":
        folder, extra = hf_family_dirs["qwen3_moe"], ["lora.rank=4", "lora.targets=[attention,mlp]"]
        phrase = "lora.targets: mlp: the blocks of"
    else:
        make, extra, phrase = BAD_FOLDERS[case]
        folder = make(tmp_path)
    run_dir = tmp_path / "run"
    proc = run_fsdprun(
        "train", "debug", f"model.hf_path={folder}", "train.steps=2", *extra,
        "--run-dir", str(run_dir), cwd=tmp_path,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and phrase in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "rank 0" not in proc.stderr, proc.stderr[-3000:]
    assert not run_dir.exists()


def test_a_folder_of_its_own_code_trains_with_trust_remote_code(tmp_path):
    """model.trust_remote_code=true runs the folder's code (transformers' own switch), and no
    rank ever waits on a question: stdin is closed."""
    folder = _remote_code(tmp_path)
    proc = run_fsdprun(
        "train", "debug", f"model.hf_path={folder}", "model.trust_remote_code=true",
        "train.steps=2", "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "final loss" in proc.stdout
    assert "[y/N]" not in proc.stdout + proc.stderr


# ---- plan answers as train's preflight does (issue 57) ----


class _WouldLaunch(Exception):
    """Raised where `fsdprun train` would take the run directory and start its workers."""


def _train_answer(monkeypatch, args: list[str]) -> str:
    """What `fsdprun train` says before it launches: its one error line, or "accepted"."""
    import fsdprun.launch.elastic as elastic

    def stop(*_a, **_k):
        raise _WouldLaunch

    monkeypatch.setattr(elastic, "hold_run_dir", stop)
    result = CliRunner().invoke(app, ["train", *args, "--run-dir", "never-made"])
    if isinstance(result.exception, _WouldLaunch):
        return "accepted"
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    return _error_line(result.output)


def _plan_answer(args: list[str]) -> str:
    result = CliRunner().invoke(app, ["plan", *args])
    if result.exit_code == 0:
        return "accepted"
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    return _error_line(result.output)


def _error_line(output: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith("error:")]
    return line


# Every rule that refuses a layout (config.layout: the shard groups, tensor and context
# parallel), the family checks on the meta model (a TP plan that does not split the model, LoRA
# on experts), and two layouts both accept.
LAYOUTS = {
    "tp does not divide the world": ["parallel.tp=3", "parallel.tp_across_nodes=true"],
    "tp spans nodes": ["parallel.tp=8", "launch.nproc_per_node=4", "launch.nnodes=2",
                       "train.global_batch_size=16"],
    "tp and the heads": ["parallel.tp=4", "model.n_kv_heads=2"],
    "tp and seq_len": ["parallel.tp=2", "train.seq_len=63", "model.max_seq_len=64"],
    "tp with fsdp1": ["parallel.tp=2", "fsdp.engine=fsdp1"],
    "tp with rowwise float8": ["parallel.tp=2", "precision.float8=rowwise"],
    "tp with the chunked loss": ["parallel.tp=2", "train.loss=chunked"],
    "tp with compile and ac": ["parallel.tp=2", "compile.enabled=true",
                               "activation_checkpointing.mode=full"],
    "tp with whole-model compile": ["parallel.tp=2", "compile.enabled=true",
                                    "compile.per_block=false"],
    "tp with cpu offload": ["parallel.tp=2", "fsdp.cpu_offload=true"],
    "cp does not divide the world": ["parallel.cp=3"],
    "cp and seq_len": ["parallel.cp=4", "train.seq_len=62", "model.max_seq_len=64"],
    "cp x tp and seq_len": ["parallel.cp=2", "parallel.tp=2", "model.n_kv_heads=4",
                            "train.seq_len=50", "model.max_seq_len=64"],
    "all-to-all and the kv heads": ["parallel.cp=4", "parallel.cp_impl=alltoall"],
    "cp with fsdp1": ["parallel.cp=2", "fsdp.engine=fsdp1"],
    "cp with rowwise float8": ["parallel.cp=2", "precision.float8=rowwise"],
    "cp with compile": ["parallel.cp=2", "compile.enabled=true"],
    "ring and seq_len": ["parallel.cp=4", "train.seq_len=36", "model.max_seq_len=64"],
    "ring with fullgraph compile": ["parallel.cp=4", "compile.enabled=true",
                                    "compile.fullgraph=true"],
    "cp with cpu offload": ["parallel.cp=2", "fsdp.cpu_offload=true"],
    "backward prefetch": ["fsdp.backward_prefetch=sideways"],
    "reshard under fsdp1": ["fsdp.engine=fsdp1", "fsdp.reshard_after_forward=false"],
    "shard group size": ["fsdp.sharding=hybrid", "fsdp.shard_group_size=3"],
    "ddp offload": ["fsdp.engine=ddp", "fsdp.cpu_offload=true"],
    "tp accepted": ["parallel.tp=2"],
    "cp accepted": ["parallel.cp=2"],
}  # fmt: skip


def test_plan_refuses_what_train_refuses_and_accepts_what_it_accepts(
    monkeypatch, hf_family_dirs, tmp_path
):
    """The same answer, word for word, from `fsdprun plan` and from `fsdprun train` up to the
    moment it would launch, for every layout refusal and the HF folders' own (context parallel
    with a router's auxiliary loss, LoRA on experts), and for layouts both accept (a mixture of
    experts under TP among them)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    moe, qwen2 = hf_family_dirs["qwen3_moe"], hf_family_dirs["qwen2"]
    aux = shutil.copytree(moe, tmp_path / "moe-aux")
    config = json.loads((aux / "config.json").read_text())
    (aux / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    cases = {
        **{name: ["debug", *FOUR, *over] for name, over in LAYOUTS.items()},
        "tp on a mixture of experts": ["debug", *FOUR, f"model.hf_path={moe}", "parallel.tp=2"],
        "cp on qwen2": ["debug", *FOUR, f"model.hf_path={qwen2}", "parallel.cp=2"],
        "cp with the router's loss": ["debug", *FOUR, f"model.hf_path={aux}", "parallel.cp=2"],
        "lora on experts": ["debug", *FOUR, f"model.hf_path={moe}", "lora.rank=4",
                            "lora.targets=[mlp]"],
    }  # fmt: skip
    answers = {name: (_plan_answer(args), _train_answer(monkeypatch, args))
               for name, args in cases.items()}  # fmt: skip
    differ = {name: pair for name, pair in answers.items() if pair[0] != pair[1]}
    assert not differ, differ
    accepted = {name for name, (plan, _) in answers.items() if plan == "accepted"}
    assert accepted == {"tp accepted", "cp accepted", "cp on qwen2", "tp with cpu offload",
                        "cp with compile", "cp with cpu offload",
                        "tp on a mixture of experts"}, answers  # fmt: skip
