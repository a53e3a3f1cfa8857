"""LoRA checkpoints (issue 15): they hold the adapters and their optimizer state only, the manifest
names the base, `resume` rebuilds the base at another world size and continues exactly, and
`export` writes merged full weights (`--format hf`) or peft's adapter folder (`--format peft`).
The manifest also fingerprints the base (issue 24): a base replaced by other weights of the same
shapes, or gone, is refused or named by the real `fsdprun` commands in one line, and nothing on
disk changes; `--accept-base-change` trains on it on purpose, `--base PATH` reads a copy.

References are independent of the export code: the adapters come from torch's own
`dcp_to_torch_save`, the merge is `W + alpha/rank * B @ A` written out here, the logits are
transformers' forward, and peft (skipped where it is not installed) loads the adapter folder.
One 2-rank run of the shipped `lora-demo` recipe (pretrained HF base) and one of `debug` with
LoRA (seeded built-in Llama base) serve every check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import Run, consolidate, flatten, run_fsdprun

from fsdprun.checkpoint.export import export_checkpoint
from fsdprun.checkpoint.fingerprint import BaseCheck, base_fingerprint, compare_base
from fsdprun.checkpoint.inspect import inspect_path
from fsdprun.checkpoint.manifest import read_manifest
from fsdprun.config import load_recipe
from fsdprun.engines.weights import init_weights
from fsdprun.errors import UserError
from fsdprun.launch.resume import resolve_resume
from fsdprun.models import build_model
from fsdprun.models.lora import apply_lora, is_adapter_name

TOL = 1e-5
HF_DIR = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
GOLDEN_CKPT = Path(__file__).parent / "golden" / "old-run" / "checkpoints" / "step-00000004"
STEPS = ("train.steps=6", "checkpoint.every_steps=3", "output.log_every=1", "eval.every_steps=0")


def _ckpt(run: Run, step: int) -> Path:
    return run.run_dir / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """The copy of the tiny HF folder that `hf_run` trains on: tests change or remove it for
    their duration (`_swapped_base`); the shipped folder is never touched."""
    base = tmp_path_factory.mktemp("lora-base") / "tiny-llama-hf"
    shutil.copytree(HF_DIR, base)
    return base


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, hf_base) -> Run:
    tmp = tmp_path_factory.mktemp("lora-hf")
    proc = run_fsdprun("train", "lora-demo", *STEPS, f"model.hf_path={hf_base}",
                       "--run-dir", str(tmp / "run"), cwd=tmp)  # fmt: skip
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


def _sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def _scale_weights(file: Path, scale: float) -> None:
    """Rewrite a safetensors file with every tensor times `scale`: same names and shapes."""
    from safetensors.torch import load_file, save_file

    save_file({k: v * scale for k, v in load_file(file).items()}, file, metadata={"format": "pt"})


@contextlib.contextmanager
def _swapped_base(base: Path, scale: float | None):
    """`base` replaced for the duration by a copy whose weights are scaled by `scale` (same
    shapes), or gone (None); yields the original, set aside, and puts it back after."""
    aside = base.with_name(f"{base.name}.aside")
    base.rename(aside)
    try:
        if scale is not None:
            shutil.copytree(aside, base)
            _scale_weights(base / "model.safetensors", scale)
        yield aside
    finally:
        if base.exists():
            shutil.rmtree(base)
        aside.rename(base)


def _snapshot(*roots: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `roots`: size, mtime and sha256 (what 'nothing on disk changed' means)."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns, _sha256(p))
        for root in roots for p in sorted(root.rglob("*")) if p.is_file()
    }  # fmt: skip


def _one_line(proc: subprocess.CompletedProcess, code: int, *phrases: str) -> str:
    """The command's one stderr line (exit `code`, no traceback), holding every phrase."""
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def test_lora_demo_trains_and_its_checkpoints_hold_only_the_adapters(hf_run, hf_base, tmp_path):
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
    # The base's fingerprint: its config.json and weights, each file's size and sha256.
    base = doc["lora_base"]
    assert (base["source"], base["path"]) == ("hf_pretrained", str(hf_base))
    assert {name: (f["bytes"], f["sha256"]) for name, f in base["files"].items()} == {
        name: ((hf_base / name).stat().st_size, _sha256(hf_base / name))
        for name in ("config.json", "model.safetensors")
    }  # fmt: skip
    assert doc["base_check"] == {"state": "same", "detail": ""}
    # The whole tiny model is 131.5K params (526 KiB in fp32): the adapters are 28 KiB.
    assert doc["groups"]["model"]["bytes"] == 7168 * 4
    proc = run_fsdprun("inspect-checkpoint", str(ckpt), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert (
        f"LoRA adapters only (16 tensors); base: the pretrained HF folder {hf_base} (verified)"
    ) in text


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


def test_peft_export_layout_and_peft_loads_it(hf_run, hf_base, tmp_path):
    ckpt = _ckpt(hf_run, 6)
    out = tmp_path / "adapter"
    result = export_checkpoint(ckpt, out, fmt="peft")
    assert sorted(result.files) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        8, 16.0, str(hf_base)
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
    # The seeded base's fingerprint is the seed and the model's shape config.
    assert doc["lora_base"] == {
        "source": "seed", "seed": 0, "model": read_manifest(ckpt)["recipe"]["model"]
    }  # fmt: skip
    assert doc["base_check"]["state"] == "same"
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


def test_one_line_refusals(hf_run, hf_base, llama_run, tmp_path):
    adapters_only = _ckpt(hf_run, 3)
    proc = run_fsdprun("train", "debug", f"checkpoint.load_from={adapters_only}",
                       "--run-dir", str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert (
        f"checkpoint.load_from: {adapters_only} holds only LoRA adapters (its base is the "
        f"pretrained HF folder {hf_base}); export it merged"
    ) in " ".join((proc.stdout + proc.stderr).split())
    with pytest.raises(UserError, match="holds no LoRA adapters; use --format hf"):
        export_checkpoint(GOLDEN_CKPT, tmp_path / "x", fmt="peft")


def test_a_changed_base_is_refused_in_one_line_and_accepted_on_purpose(hf_run, hf_base, tmp_path):
    """The base folder's weights replaced by others of the same shapes (x1.5): resume, export
    (hf, peft) and inspect refuse, naming the file and the flag; nothing on disk changes. Then
    `--accept-base-change` resumes on it, and its checkpoints record the new base."""
    run_dir = tmp_path / "run"
    shutil.copytree(hf_run.run_dir, run_dir)
    ckpt = run_dir / "checkpoints" / "step-00000003"
    changed = "model.safetensors differs"
    with _swapped_base(hf_base, 1.5):
        before = _snapshot(tmp_path, hf_base)
        proc = run_fsdprun("resume", str(run_dir), cwd=tmp_path)
        _one_line(proc, 2, str(hf_base), changed, "resume with --accept-base-change")
        for fmt in ("hf", "peft"):
            proc = run_fsdprun("export", str(ckpt), "--format", fmt, "--out",
                               str(tmp_path / fmt), cwd=tmp_path)  # fmt: skip
            _one_line(proc, 2, changed, f"export --format {fmt} with --accept-base-change")
        proc = run_fsdprun("inspect-checkpoint", str(ckpt), cwd=tmp_path)
        _one_line(proc, 2, changed, "resume or export with --accept-base-change")
        assert "CHANGED since the save" in " ".join(proc.stdout.split())
        assert _snapshot(tmp_path, hf_base) == before  # no lock, no partial export left

        proc = run_fsdprun("resume", str(run_dir), "--step", "3", "--accept-base-change",
                           "launch.nproc_per_node=1", cwd=tmp_path)  # fmt: skip
        resumed = Run(proc, run_dir).check()
        assert "note: the LoRA base changed (model.safetensors differs" in proc.stderr
        new_sha = _sha256(hf_base / "model.safetensors")
    # The adapters trained on the scaled weights: other losses than on the original base.
    assert resumed.losses[6:] != pytest.approx(hf_run.losses[3:], rel=1e-3)
    recorded = read_manifest(run_dir / "checkpoints" / "step-00000006")["lora_base"]
    assert recorded["files"]["model.safetensors"]["sha256"] == new_sha
    # With the original base back, that checkpoint's base is the changed one.
    check = inspect_path(run_dir / "checkpoints" / "step-00000006")["base_check"]
    assert check["state"] == "changed" and check["detail"].startswith(changed), check


def test_a_missing_base_is_named_and_a_copy_can_stand_in(hf_run, hf_base, tmp_path):
    """The base folder gone: hf export and resume refuse in one line naming the folder and
    --base; peft export writes its folder with a one-line note; inspect marks the base missing.
    `--base` reads a copy (checked: a copy of other weights is refused)."""
    run_dir = tmp_path / "run"
    shutil.copytree(hf_run.run_dir, run_dir)
    ckpt = run_dir / "checkpoints" / "step-00000006"
    missing = f"the pretrained HF folder {hf_base}, is missing (no folder {hf_base})"
    other = tmp_path / "other-base"
    with _swapped_base(hf_base, None) as original:
        shutil.copytree(original, other)
        _scale_weights(other / "model.safetensors", 1.5)
        before = _snapshot(run_dir, original, other)
        proc = run_fsdprun("export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"),
                           cwd=tmp_path)  # fmt: skip
        _one_line(proc, 2, missing, "export --format hf with --base PATH")
        assert not (tmp_path / "hf").exists()
        proc = run_fsdprun("resume", str(run_dir), "train.steps=9", cwd=tmp_path)
        _one_line(proc, 2, missing, "resume with --base PATH")
        proc = run_fsdprun("resume", str(run_dir), "train.steps=9", "--base", str(other),
                           cwd=tmp_path)  # fmt: skip
        _one_line(proc, 2, f"HF folder {other}: model.safetensors differs")
        proc = run_fsdprun("inspect-checkpoint", str(ckpt), cwd=tmp_path)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
        assert f"(MISSING: no folder {hf_base})" in " ".join(proc.stdout.split())
        assert _snapshot(run_dir, original, other) == before

        peft_out = tmp_path / "peft"
        proc = run_fsdprun("export", str(ckpt), "--format", "peft", "--out", str(peft_out),
                           cwd=tmp_path)  # fmt: skip
        note = _one_line(proc, 0, f"note: the LoRA base, the pretrained HF folder {hf_base}, "
                                  "is missing here")  # fmt: skip
        assert "base_model_name_or_path" in note
        config = json.loads((peft_out / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(hf_base)
        # A copy of the right base stands in: the same merged weights as from the base itself.
        copy = tmp_path / "copy"
        shutil.copytree(original, copy)
        result = export_checkpoint(ckpt, tmp_path / "merged", fmt="hf", base=copy)
        assert result.notes == []
    reference = tmp_path / "reference"
    export_checkpoint(ckpt, reference, fmt="hf")
    assert _sha256(tmp_path / "merged" / "model.safetensors") == _sha256(
        reference / "model.safetensors"
    )


def test_a_manifest_without_fingerprint_still_resumes_with_a_note(hf_run, tmp_path):
    """Checkpoints of an older fsdprun name the base by path alone: they resume and export, and
    say the base cannot be verified."""
    run_dir = tmp_path / "run"
    shutil.copytree(hf_run.run_dir, run_dir)
    ckpt = run_dir / "checkpoints" / "step-00000006"
    manifest = read_manifest(ckpt)
    manifest["lora_base"] = {k: manifest["lora_base"][k] for k in ("source", "path")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    resume = resolve_resume(run_dir, ["train.steps=9"])
    assert resume.notes[0] == (
        "the LoRA base cannot be verified: step-00000006 was saved by an older fsdprun without "
        "its fingerprint"
    )
    result = export_checkpoint(ckpt, tmp_path / "peft", fmt="peft")
    assert result.notes and "cannot be verified" in result.notes[0]
    proc = run_fsdprun("inspect-checkpoint", str(ckpt), cwd=tmp_path)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert "not verifiable (saved without its fingerprint" in " ".join(proc.stdout.split())


def test_seed_and_load_from_bases_are_fingerprinted(llama_run, tmp_path):
    """A seeded base: the seed and the model config; a load_from base: its step and checksums.
    Each change is named; a resume on the unchanged seeded base has nothing to say."""
    run_dir = tmp_path / "run"
    shutil.copytree(llama_run.run_dir, run_dir)
    notes = resolve_resume(run_dir, ["train.steps=9"]).notes
    assert not [n for n in notes if "base" in n], notes  # the same base: nothing to say
    recipe = read_manifest(_ckpt(llama_run, 6))["recipe"]
    recorded = base_fingerprint(recipe)
    assert compare_base(recorded, recipe).state == "same"
    reseeded = {**recipe, "train": {**recipe["train"], "seed": 1}}
    assert compare_base(recorded, reseeded) == BaseCheck("changed", "train.seed 0 -> 1")
    dim = recipe["model"]["dim"]
    wider = {**recipe, "model": {**recipe["model"], "dim": 2 * dim}}
    assert compare_base(recorded, wider) == BaseCheck("changed", f"model.dim {dim} -> {2 * dim}")

    base = tmp_path / "base" / "step-00000004"
    shutil.copytree(GOLDEN_CKPT, base)
    on_ckpt = {**recipe, "checkpoint": {**recipe["checkpoint"], "load_from": str(base)}}
    recorded = base_fingerprint(on_ckpt)
    assert (recorded["source"], recorded["step"]) == ("load_from", 4)
    assert compare_base(recorded, on_ckpt).state == "same"
    manifest = read_manifest(base)
    first = sorted(manifest["sha256"])[0]
    manifest["sha256"][first] = "0" * 64  # other shard contents, same names and sizes
    (base / "manifest.json").write_text(json.dumps(manifest))
    assert compare_base(recorded, on_ckpt).detail == f"the checksums of {base}'s files differ"
    manifest["step"] = 5
    (base / "manifest.json").write_text(json.dumps(manifest))
    assert compare_base(recorded, on_ckpt).detail == (
        f"{base} is now step 5's checkpoint (was step 4's)"
    )
    shutil.rmtree(base)
    assert compare_base(recorded, on_ckpt) == BaseCheck("missing", f"no folder {base}")
