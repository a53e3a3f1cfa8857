"""LoRA checkpoints (issue 15): they hold the adapters and their optimizer state only, the manifest
names the base, `resume` rebuilds the base at another world size and continues exactly, and
`export` writes merged full weights (`--format hf`) or peft's adapter folder (`--format peft`).

References are independent of the export code: the adapters come from torch's own
`dcp_to_torch_save`, the merge is `W + alpha/rank * B @ A` written out here, the logits are
transformers' forward, and peft (skipped where it is not installed) loads the adapter folder.
One 2-rank run of the shipped `lora-demo` recipe (pretrained HF base) and one of `debug` with
LoRA (seeded built-in Llama base) serve every check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import Run, consolidate, flatten, run_fsdprun

from fsdprun.checkpoint.export import export_checkpoint
from fsdprun.checkpoint.inspect import inspect_path
from fsdprun.config import load_recipe
from fsdprun.engines.weights import init_weights
from fsdprun.errors import UserError
from fsdprun.models import build_model
from fsdprun.models.lora import apply_lora, is_adapter_name

TOL = 1e-5
HF_DIR = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
GOLDEN_CKPT = Path(__file__).parent / "golden" / "old-run" / "checkpoints" / "step-00000004"
STEPS = ("train.steps=6", "checkpoint.every_steps=3", "output.log_every=1", "eval.every_steps=0")


def _ckpt(run: Run, step: int) -> Path:
    return run.run_dir / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("lora-hf")
    proc = run_fsdprun("train", "lora-demo", *STEPS, "--run-dir", str(tmp / "run"), cwd=tmp)
    return Run(proc, tmp / "run").check()


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("lora-llama")
    proc = run_fsdprun(
        "train", "debug", "lora.rank=4", "lora.targets=[wq, wv, w2]", "optim.lr=1e-2",
        "precision.param_dtype=fp32", *STEPS, "--run-dir", str(tmp / "run"), cwd=tmp,
    )  # fmt: skip
    return Run(proc, tmp / "run").check()


def _saved_adapters(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors, consolidated by torch's own DCP converter."""
    state = flatten(consolidate(ckpt, tmp / "full.pt"))
    return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def _merge_into(model: torch.nn.Module, adapters: dict[str, torch.Tensor], *, scale: float,
                strip: str = "") -> None:  # fmt: skip
    """transformers' `model` with `W += scale * B @ A` for each adapter pair (HF names)."""
    for name, a in adapters.items():
        if name.endswith(".lora_A.weight"):
            path = name.removesuffix(".lora_A.weight")
            b = adapters[f"{path}.lora_B.weight"]
            model.get_parameter(f"{path.removeprefix(strip)}.weight").add_(scale * (b @ a))


def test_lora_demo_trains_and_its_checkpoints_hold_only_the_adapters(hf_run, tmp_path):
    losses = hf_run.losses
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    ckpt = _ckpt(hf_run, 3)
    doc = inspect_path(ckpt)
    names = {t["name"] for t in doc["tensors"]}
    model_keys = {n.removeprefix("model.") for n in names if n.startswith("model.")}
    # 2 blocks x 4 attention projections x (A, B); the frozen base is not stored.
    assert len(model_keys) == 16 and all(map(is_adapter_name, model_keys)), model_keys
    optim_keys = {n for n in names if n.startswith("optim.")}
    assert {k.split(".", 2)[2].rsplit(".", 1)[0] for k in optim_keys} == model_keys
    assert doc["lora_base"] == {"source": "hf_pretrained", "path": str(HF_DIR)}
    # The whole tiny model is 131.5K params (526 KiB in fp32): the adapters are 28 KiB.
    assert doc["groups"]["model"]["bytes"] == 7168 * 4
    proc = run_fsdprun("inspect-checkpoint", str(ckpt), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert f"LoRA adapters only (16 tensors); base: the pretrained HF folder {HF_DIR}" in text


def test_lora_resume_at_another_world_size_continues_with_the_same_losses(hf_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(hf_run.run_dir, run_dir)
    proc = run_fsdprun("resume", str(run_dir), "--step", "3", "launch.nproc_per_node=1",
                       cwd=tmp_path)  # fmt: skip
    resumed = Run(proc, run_dir).check()
    event = next(e for e in resumed.events if e["event"] == "resume")
    assert (event["saved_world_size"], event["world_size"]) == (2, 1)
    assert [e["step"] for e in resumed.steps][6:] == [4, 5, 6]
    assert resumed.losses[6:] == pytest.approx(hf_run.losses[3:], abs=TOL, rel=TOL)


def test_merged_hf_export_gives_the_logits_of_base_plus_adapters(hf_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt = _ckpt(hf_run, 6)
    out = tmp_path / "merged"
    proc = run_fsdprun("export", str(ckpt), "--format", "hf", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.iterdir()} == {
        "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"
    }  # fmt: skip

    def load(folder: Path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True
        ).eval()

    merged, reference = load(out), load(HF_DIR)
    adapters = _saved_adapters(ckpt, tmp_path)
    _merge_into(reference, adapters, scale=16 / 8, strip="hf.")
    tokens = _tokens(257)
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        assert not torch.allclose(load(HF_DIR)(input_ids=tokens).logits, expected, atol=1e-2)
        torch.testing.assert_close(merged(input_ids=tokens).logits, expected, atol=TOL, rtol=TOL)


def test_peft_export_layout_and_peft_loads_it(hf_run, tmp_path):
    ckpt = _ckpt(hf_run, 6)
    out = tmp_path / "adapter"
    result = export_checkpoint(ckpt, out, fmt="peft")
    assert sorted(result.files) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        8, 16.0, str(HF_DIR)
    )  # fmt: skip
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    from safetensors.torch import load_file

    saved = load_file(out / "adapter_model.safetensors")
    adapters = _saved_adapters(ckpt, tmp_path)
    assert set(saved) == {f"base_model.model.{k.removeprefix('hf.')}" for k in adapters}
    for key, value in adapters.items():
        assert torch.equal(saved[f"base_model.model.{key.removeprefix('hf.')}"], value), key

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        HF_DIR, dtype=torch.float32, local_files_only=True
    )
    peft_model = peft.PeftModel.from_pretrained(base, out).eval()
    merged = tmp_path / "merged"
    export_checkpoint(ckpt, merged, fmt="hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        merged, dtype=torch.float32, local_files_only=True
    ).eval()
    tokens = _tokens(257)
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, expected,
                                   atol=TOL, rtol=TOL)  # fmt: skip


def test_peft_export_of_path_pattern_targets_adapts_exactly_the_trained_modules(tmp_path):
    # Issue 20: targets given as paths were written as their leaf names (`q_proj`), so peft put
    # adapters on every layer (warning about missing keys) and gave other logits.
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    targets = "lora.targets=[model.layers.1.self_attn.q_proj, layers.0.mlp.*_proj]"
    proc = run_fsdprun("train", "lora-demo", targets, "train.steps=2", "eval.every_steps=0",
                       "launch.nproc_per_node=1", "--run-dir", str(tmp_path / "run"),
                       cwd=tmp_path)  # fmt: skip
    ckpt = _ckpt(Run(proc, tmp_path / "run").check(), 2)
    trained = {"model.layers.1.self_attn.q_proj", "model.layers.0.mlp.gate_proj",
               "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}  # fmt: skip
    assert {k.removeprefix("hf.").rsplit(".", 2)[0] for k in _saved_adapters(ckpt, tmp_path)} == (
        trained
    )
    out = tmp_path / "adapter"
    export_checkpoint(ckpt, out, fmt="peft")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(trained)

    def load(folder: Path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True
        ).eval()

    peft_model = peft.PeftModel.from_pretrained(load(HF_DIR), out).eval()
    adapted = {
        name.removeprefix("base_model.model.")
        for name, module in peft_model.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }
    assert adapted == trained
    export_checkpoint(ckpt, tmp_path / "merged", fmt="hf")
    tokens = _tokens(257)
    with torch.no_grad():
        expected = load(tmp_path / "merged")(input_ids=tokens).logits
        assert not torch.allclose(load(HF_DIR)(input_ids=tokens).logits, expected, atol=1e-3)
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, expected,
                                   atol=TOL, rtol=TOL)  # fmt: skip


def test_seeded_llama_base_is_rebuilt_for_the_merged_export(llama_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt = _ckpt(llama_run, 6)
    doc = inspect_path(ckpt)
    assert doc["lora_base"] == {"source": "seed", "seed": 0}
    assert all(is_adapter_name(t["name"].removeprefix("model.")) for t in doc["tensors"]
               if t["name"].startswith("model."))  # fmt: skip
    out = tmp_path / "merged"
    export_checkpoint(ckpt, out, fmt="hf")
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, local_files_only=True
    ).eval()
    # The reference: fsdprun's Llama with LoRA (unmerged), its base at the seeded init of any
    # world size, with the adapters torch consolidated from the 2-rank checkpoint.
    cfg = load_recipe("debug", ["lora.rank=4", "lora.targets=[wq, wv, w2]"]).config
    with torch.device("meta"):
        model = build_model(cfg.model)
    apply_lora(model, cfg=cfg.lora)
    init_weights(model, seed=0, device=torch.device("cpu"))
    missing, unexpected = model.load_state_dict(_saved_adapters(ckpt, tmp_path), strict=False)
    assert not unexpected and all(not is_adapter_name(k) for k in missing)
    tokens = _tokens(256)
    with torch.no_grad():
        expected = model.eval()(tokens)
        torch.testing.assert_close(merged(input_ids=tokens).logits, expected, atol=TOL, rtol=TOL)


def test_one_line_refusals(hf_run, llama_run, tmp_path):
    adapters_only = _ckpt(hf_run, 3)
    proc = run_fsdprun("train", "debug", f"checkpoint.load_from={adapters_only}",
                       "--run-dir", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert (
        f"checkpoint.load_from: {adapters_only} holds only LoRA adapters (its base is the "
        f"pretrained HF folder {HF_DIR}); export it merged"
    ) in " ".join((proc.stdout + proc.stderr).split())
    with pytest.raises(UserError, match="holds no LoRA adapters; use --format hf"):
        export_checkpoint(GOLDEN_CKPT, tmp_path / "x", fmt="peft")
