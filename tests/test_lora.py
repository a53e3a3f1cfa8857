"""LoRA (issue 15): adapters start as the base model, merge into plain weights under the original
names with the same logits, train alone (optimizer state only for them), shard with fully_shard
on 2 gloo ranks holding what `plan` says, and load in peft's own layout into transformers.

References are independent where one exists: the base model built without LoRA, transformers'
forward, peft's `PeftModel.from_pretrained` (skipped where peft is not installed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_fsdprun
from torch import nn

from fsdprun.checkpoint.export import export_checkpoint
from fsdprun.config import LoraConfig, load_recipe
from fsdprun.engines.weights import init_weights
from fsdprun.errors import UserError
from fsdprun.fmt import fmt_count
from fsdprun.models import build_model
from fsdprun.models.lora import (
    LoraLinear,
    adapter_state_dict,
    apply_lora,
    merge_lora,
    merged_state_dict,
    peft_adapter_config,
    peft_state_dict,
)
from fsdprun.report.metrics import read_events
from fsdprun.tools.plan import plan_memory
from fsdprun.train.optim import build_optimizer

TOL = 1e-5
CPU = torch.device("cpu")
HF_DIR = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
# The debug model (dim 64, 2 blocks), fp32 so that logits compare to 1e-5.
DEBUG = ["precision.param_dtype=fp32"]


def _cfg(*overrides: str):
    return load_recipe("debug", [*DEBUG, *overrides]).config


def _llama(cfg, *, lora: bool) -> nn.Module:
    """The debug Llama, seeded init (the same values for a name with or without LoRA)."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    if lora:
        apply_lora(model, cfg=cfg.lora)
    init_weights(model, seed=0, device=CPU)
    return model.eval()


def _hf(cfg, *, lora: bool) -> nn.Module:
    """The shipped tiny HF Llama with its pretrained weights, as the worker loads it."""
    from fsdprun.engines.adapters import init_adapters
    from fsdprun.engines.hf_weights import HFWeights
    from fsdprun.models.hf import HFCausalLM

    with torch.device("meta"):
        model = HFCausalLM.from_folder(HF_DIR)
    if lora:
        apply_lora(model, cfg=cfg.lora)
    HFWeights(HF_DIR, model).load(model, device=CPU)
    init_adapters(model, seed=0, device=CPU)
    return model.eval()


BUILDERS = {"llama": _llama, "hf": _hf}


def _tokens(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _perturb_adapters(model: nn.Module) -> None:
    """Non-zero B (it starts at zero), so merged weights differ from the base."""
    gen = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if name.endswith("lora_B.weight"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("arch", ["llama", "hf"])
def test_lora_model_starts_exactly_as_the_base(arch):
    cfg = _cfg("lora.rank=4", "lora.targets=[q_proj, v_proj, down_proj]", "lora.dropout=0.1")
    base, lora = BUILDERS[arch](cfg, lora=False), BUILDERS[arch](cfg, lora=True)
    adapted = [m for m in lora.modules() if isinstance(m, LoraLinear)]
    assert len(adapted) == 3 * 2  # three targets in each of the two blocks
    # Base weights keep their names and values; the adapters add lora_A/lora_B only.
    base_state, lora_state = base.state_dict(), lora.state_dict()
    assert set(lora_state) - set(base_state) == set(adapter_state_dict(lora))
    for name, value in base_state.items():
        assert torch.equal(lora_state[name], value), name
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(lora(tokens), base(tokens))


@pytest.mark.parametrize("arch", ["llama", "hf"])
def test_merged_weights_give_the_adapted_logits(arch):
    cfg = _cfg("lora.rank=4", "lora.alpha=8", "lora.targets=[wq, wk, wv, wo, w1, w2, w3]")
    lora = BUILDERS[arch](cfg, lora=True)
    _perturb_adapters(lora)
    tokens = _tokens()
    with torch.no_grad():
        expected = lora(tokens)
        merged = merged_state_dict(lora)
        base = BUILDERS[arch](cfg, lora=False)
        assert not torch.allclose(base(tokens), expected, atol=1e-3)  # the adapters do something
        # Original names exactly: a strict load into the base architecture.
        base.load_state_dict(merged, strict=True)
        torch.testing.assert_close(base(tokens), expected, atol=TOL, rtol=TOL)
        merge_lora(lora)  # in place: plain Linears again, same names
        assert not any(isinstance(m, LoraLinear) for m in lora.modules())
        assert set(lora.state_dict()) == set(base.state_dict())
        torch.testing.assert_close(lora(tokens), expected, atol=TOL, rtol=TOL)


def test_only_adapters_train_and_only_they_have_optimizer_state():
    cfg = _cfg("lora.rank=4", "lora.dropout=0.1")
    model = _llama(cfg, lora=True).train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state_dict(model)) and trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg=cfg.optim, device_kind="cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    for _ in range(2):
        logits = model(_tokens())
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), _tokens().flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    assert {names[id(p)] for p in optimizer.state} == trainable
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
        # The frozen base is untouched; every adapter matrix moved (B from zero after step 1).
        assert torch.equal(p, before[name]) == (name not in trainable), name


def test_plan_drops_gradients_and_optimizer_state_of_the_frozen_base():
    full = plan_memory(_cfg("launch.nproc_per_node=8", "train.global_batch_size=16"))
    lora = plan_memory(_cfg("launch.nproc_per_node=8", "train.global_batch_size=16",
                            "lora.rank=4"))  # fmt: skip
    f, lo = full.strategies["full"], lora.strategies["full"]
    # 2 blocks x rank 4 x (in + out) of wq, wo (64 -> 64) and wk, wv (64 -> 32: GQA).
    assert lora.num_trainable_params == 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32))
    # Parameters grow by the adapters only; gradients and AdamW state are the adapters' alone.
    assert lo.params > f.params
    assert lo.grads < f.grads / 20
    # AdamW: two fp32 moments per adapter element and a 4-byte step for each of the 16 matrices.
    assert lo.optimizer == 2 * lo.grads + 4 * 16
    assert any(note.startswith("lora: rank 4") for note in lora.notes)


def test_peft_layout_and_config_for_both_architectures(tmp_path):
    cfg = _cfg("lora.rank=4", "lora.targets=[q_proj, down_proj]")
    llama = peft_state_dict(adapter_state_dict(_llama(cfg, lora=True)))
    assert set(llama) == {
        f"base_model.model.model.layers.{i}.{mod}.lora_{ab}.weight"
        for i in range(2) for mod in ("self_attn.q_proj", "mlp.down_proj") for ab in "AB"
    }  # fmt: skip
    assert llama["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert llama["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    hf_adapters = adapter_state_dict(_hf(cfg, lora=True))
    assert set(peft_state_dict(hf_adapters)) == set(llama)  # the HF model's names are the same
    content = peft_adapter_config(hf_adapters, cfg=cfg.lora, base_model_name_or_path="base")
    assert content["peft_type"] == "LORA" and content["task_type"] == "CAUSAL_LM"
    assert (content["r"], content["lora_alpha"], content["lora_dropout"]) == (4, 16.0, 0.0)
    assert content["target_modules"] == ["down_proj", "q_proj"] and content["bias"] == "none"


def test_peft_loads_the_adapter_folder_with_the_same_logits(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from fsdprun.engines.adapters import save_peft_adapter

    cfg = _cfg("lora.rank=4", "lora.alpha=8", "lora.targets=[q_proj, v_proj, up_proj]")
    lora = _hf(cfg, lora=True)
    _perturb_adapters(lora)
    folder = tmp_path / "adapter"
    save_peft_adapter(folder, adapter_state_dict(lora), cfg=cfg.lora,
                      base_model_name_or_path=str(HF_DIR))  # fmt: skip
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    base = transformers.AutoModelForCausalLM.from_pretrained(
        HF_DIR, dtype=torch.float32, local_files_only=True
    )
    peft_model = peft.PeftModel.from_pretrained(base, folder).eval()
    tokens = _tokens()
    with torch.no_grad():
        expected = lora(tokens)
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, expected,
                                   atol=TOL, rtol=TOL)  # fmt: skip
        # peft's own merge agrees with ours.
        merged = peft_model.merge_and_unload().state_dict()
    ours = {k.removeprefix("hf."): v for k, v in merged_state_dict(lora).items()}
    for key, value in merged.items():
        torch.testing.assert_close(ours[key], value, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.rank=-1"], "lora.rank must be >= 0 (got -1); 0 turns LoRA off"),
        (["lora.rank=4", "lora.dropout=1"], "lora.dropout must be in [0, 1) (got 1.0)"),
        (["lora.rank=4", "lora.alpha=0"], "lora.alpha must be > 0 (got 0.0)"),
        (["lora.rank=4", "lora.targets=[]"],
         "lora.targets is empty; list Linear layers such as [attention, mlp] or [q_proj, "
         "v_proj]"),
        (["lora.rank=4", "fsdp.engine=fsdp1"],
         "lora.rank=4 needs fsdp.engine=fsdp2 or ddp (got fsdp1); set fsdp.engine=fsdp2"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(UserError) as e:
        load_recipe("debug", overrides)
    assert str(e.value) == message


def test_a_target_matching_no_linear_names_the_available_ones():
    with torch.device("meta"):
        model = build_model(_cfg().model)
    with pytest.raises(UserError) as e:
        apply_lora(model, cfg=LoraConfig(rank=4, targets=["q_proj", "qkv", "lm_head"]))
    assert str(e.value) == (
        "lora.targets: qkv, lm_head match no Linear layer of this model's blocks; its Linear "
        "layers are w1, w2, w3, wk, wo, wq, wv (or give a path pattern such as "
        "layers.*.attention.wq, or the groups attention and mlp)"
    )
    # Path patterns select by position: only block 1's query projection.
    assert apply_lora(model, cfg=LoraConfig(rank=4, targets=["layers.1.*.wq"])) == [
        "layers.1.attention.wq"
    ]


def test_two_rank_fully_shard_run_trains_adapters_and_holds_what_plan_says(tmp_path):
    # fsdp2, one unit per block (frozen base and trainable adapters in the same unit), bf16
    # compute with fp32 master weights and reduction.
    overrides = ["lora.rank=8", "lora.targets=[wq, wk, wv, wo, w1, w2, w3]", "optim.lr=1e-2",
                 "precision.param_dtype=bf16", "train.steps=10", "output.log_every=1",
                 "checkpoint.save_final=false"]  # fmt: skip
    run_dir = tmp_path / "run"
    proc = run_fsdprun("train", "debug", *overrides, "--run-dir", str(run_dir), cwd=tmp_path,
                       timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    events = read_events(run_dir / "metrics.jsonl")
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.1, losses
    summary = next(e for e in events if e["event"] == "summary")
    # The header: LoRA's settings and the adapters' share, counted here from the shapes.
    m = load_recipe("debug", overrides).config.model
    kv, head = m.n_kv_heads * (m.dim // m.n_heads), m.dim
    shapes = [(m.dim, head), (m.dim, kv), (m.dim, kv), (head, m.dim),
              (m.dim, m.ffn_dim), (m.ffn_dim, m.dim), (m.dim, m.ffn_dim)]  # fmt: skip
    adapters = m.n_layers * sum(8 * (fan_in + fan_out) for fan_in, fan_out in shapes)
    start = next(e for e in events if e["event"] == "start")
    total = start["num_params"] + adapters
    assert start["num_trainable_params"] == adapters
    assert (f"  LoRA: rank 8, alpha 16 (scale 2), dropout 0, on {7 * m.n_layers} Linears (wq, wk, "
            f"wv, wo, w1, w2, w3); trainable {fmt_count(adapters)} of {fmt_count(total)} params "
            f"({100 * adapters / total:.2f}%)\n") in proc.stdout  # fmt: skip
    assert "  weights: random init (train.seed=0)\n" in proc.stdout
    plan = plan_memory(load_recipe("debug", overrides).config)
    planned = plan.strategies["full"]
    assert plan.world_size == 2
    for rank in summary["ranks"]:
        measured = rank["model_state_bytes"]
        assert (measured["params"], measured["grads"], measured["optimizer"]) == (
            planned.params, planned.grads, planned.optimizer
        ), rank["rank"]  # fmt: skip


def test_pretrained_hf_model_with_lora_starts_at_the_base_loss_and_resumes(tmp_path, gloo_pool):
    # The worker's pretrained path: HFWeights reads the base weights only, the adapters get
    # their seeded init (B = 0), so step 1's loss is the pretrained model's own. A full (non-LoRA)
    # checkpoint as checkpoint.load_from gives LoRA its base weights, and such a run resumes. (A
    # LoRA run on the pretrained base resuming: test_lora_checkpoint.py.)
    headers = {}

    def train(name: str, *extra: str, command: str = "train") -> list[float]:
        run_dir = tmp_path / name
        args = [command, str(run_dir)] if command == "resume" else [
            command, "hf-finetune-demo", "train.steps=4", "output.log_every=1",
            "eval.every_steps=0", "--run-dir", str(run_dir),
        ]  # fmt: skip
        proc = run_fsdprun(*args, *extra, cwd=tmp_path, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        headers[command, name] = [ln for ln in proc.stdout.splitlines() if "weights:" in ln]
        events = read_events(run_dir / "metrics.jsonl")
        return [e["loss"] for e in events if e["event"] == "step"]

    base = train("base")
    # The LoRA run's first two steps are all it shows: trained in the session's gloo process
    # group (tests/gloo_pool.py), two ranks as launched.
    lora = gloo_pool.train(
        "train.steps=2", "output.log_every=1", "eval.every_steps=0", "lora.rank=8",
        "checkpoint.save_final=false", recipe="hf-finetune-demo",
    ).losses  # fmt: skip
    assert lora[0] == pytest.approx(base[0], abs=1e-6)
    assert lora[1] != pytest.approx(base[1], abs=1e-4)  # then the adapters train (and only they)
    ckpt = tmp_path / "base" / "checkpoints" / "step-00000004"
    tuned = train(
        "tuned", "lora.rank=8", f"checkpoint.load_from={ckpt}", "checkpoint.every_steps=2"
    )
    assert tuned[0] < base[0] - 0.01, (tuned, base)  # starts from the fine-tuned base weights
    # The LoRA checkpoint holds the adapters only: a resume rebuilds the load_from base (the
    # pretrained base would give other losses) and continues exactly.
    resumed = train("tuned", "--step", "2", command="resume")
    assert resumed[4:] == pytest.approx(tuned[2:], abs=1e-5), (resumed, tuned)
    # The header names where each run's weights came from.
    hf = load_recipe("hf-finetune-demo").config.model.hf_path
    assert headers["train", "base"] == [f"  weights: pretrained, read from {hf}"]
    assert headers["train", "tuned"] == [f"  weights: loaded from {ckpt} (checkpoint.load_from)"]
    assert headers["resume", "tuned"] == [
        f"  weights: loaded from {ckpt} (checkpoint.load_from); adapters resumed from "
        f"{tmp_path / 'tuned' / 'checkpoints' / 'step-00000002'}"
    ]
    # The merged export reads the base from the load_from checkpoint too: a tensor without an
    # adapter is the fine-tuned base's, an adapted one differs from it.
    out = tmp_path / "export"
    export_checkpoint(tmp_path / "tuned" / "checkpoints" / "step-00000004", out, fmt="hf")
    from safetensors.torch import load_file

    merged = load_file(out / "model.safetensors")
    base_export = tmp_path / "base-export"
    export_checkpoint(ckpt, base_export, fmt="hf")
    fine_tuned = load_file(base_export / "model.safetensors")
    assert torch.equal(merged["model.embed_tokens.weight"], fine_tuned["model.embed_tokens.weight"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], fine_tuned[q], atol=1e-6)
