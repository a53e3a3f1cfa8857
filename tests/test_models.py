"""The model-family registry (`fsdprun.models`): which spec a recipe gets, its one-line errors, a
toy family registered through the registry alone and planned, and `plan` of an HF folder agreeing
with the built-in Llama of the same shapes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fsdprun.cli import app
from fsdprun.config import ModelConfig, load_recipe
from fsdprun.errors import UserError
from fsdprun.models import FAMILIES, ModelSpec, model_spec
from fsdprun.models.llama import ModelArgs, build_model_args, flops_per_token, num_params
from fsdprun.tools.plan import plan_recipe

HF_DEMO = Path(__file__).parent.parent / "recipes" / "data" / "tiny-llama-hf"


# --------------------------------------------------------------------------------------------
# A toy family, defined here and registered only through `FAMILIES` (the `toy_family` fixture):
# a causal LM whose blocks are residual MLPs, with no attention at all.


class ToyBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ToyLM(nn.Module):
    family_name = "model.family toy"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.args = ModelArgs(
            dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
            ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len,
        )  # fmt: skip
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict(
            {str(i): ToyBlock(cfg.dim, cfg.ffn_dim) for i in range(cfg.n_layers)}
        )
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, head=None) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if head is None else head(h, self.head.weight)

    def block_paths(self) -> list[str]:
        return [f"layers.{name}" for name in self.layers]

    def init_std(self, name: str) -> float | None:
        return 0.02

    def init_buffers(self, device: torch.device) -> None:
        pass


def _toy_num_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.dim * 2 + cfg.n_layers * 2 * cfg.dim * cfg.ffn_dim


SPEC = ModelSpec(
    name="toy",
    build=ToyLM,
    shape=lambda cfg: cfg,
    num_params=_toy_num_params,
    flops_per_token=lambda cfg, seq_len: 6 * _toy_num_params(cfg),
    describe=lambda cfg: f"toy: dim {cfg.dim}",
    tied_params=lambda cfg: {},
    hf_name=lambda name: name,
    hf_config=lambda cfg, dtype: {"model_type": "toy"},
    hf_files=lambda cfg: [],
)


@pytest.fixture
def toy_family(monkeypatch):
    """The one line a new family adds to the registry (this module defines its SPEC)."""
    monkeypatch.setitem(FAMILIES, "toy", __name__)


def test_a_family_registered_only_in_the_registry_is_validated_built_and_planned(toy_family):
    cfg = load_recipe("debug", ["model.family=toy"]).config
    assert model_spec(cfg.model) is SPEC
    plan = plan_recipe("debug", ["model.family=toy"], world_size=4)
    assert plan.num_params == _toy_num_params(cfg.model)
    assert [u.path for u in plan.units] == ["layers.0", "layers.1", ""]
    # Rank 0 of 4 holds a quarter of every (evenly divisible) parameter, 4 B each.
    assert plan.strategies["full"].params == 4 * _toy_num_params(cfg.model) // 4


# --------------------------------------------------------------------------------------------
# Choosing a spec, and the errors


def test_model_spec_follows_family_and_hf_path():
    assert model_spec(ModelConfig()).name == "llama"
    assert model_spec(ModelConfig(hf_path="some/folder")).name == "hf"
    assert model_spec(ModelConfig(family="hf", hf_path="some/folder")).name == "hf"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (ModelConfig(family="gpt9"), "'gpt9' is not known; the families are llama, hf$"),
        (ModelConfig(family="hf"), "model.family: 'hf' needs model.hf_path"),
    ],
)  # fmt: skip
def test_model_spec_refuses_in_one_line(model, message):
    with pytest.raises(UserError, match=message) as error:
        model_spec(model)
    assert "\n" not in str(error.value)


def test_config_validation_names_the_registered_families(toy_family):
    with pytest.raises(UserError, match="the families are llama, hf, toy"):
        load_recipe("debug", ["model.family=gpt9"])


def test_registry_loads_no_torch():
    # (models never importing torch.distributed is tests/test_imports.py's rule)
    code = "import sys, fsdprun.config, fsdprun.models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_llama_spec_counts_and_describes_as_before():
    cfg = load_recipe("debug", ["model.tie_embeddings=true"]).config.model
    spec = model_spec(cfg)
    args = build_model_args(cfg)
    assert spec.num_params(cfg) == num_params(args)
    assert spec.flops_per_token(cfg, 64) == flops_per_token(args, 64)
    assert spec.describe(cfg) == "llama: dim 64, 2 layers, 4 heads (2 kv), ffn 192, vocab 256"
    assert spec.tied_params(cfg) == {"output.weight": "tok_embeddings.weight"}


# --------------------------------------------------------------------------------------------
# HF folders: counted on the meta device, planned like the Llama of the same shapes


def test_hf_plan_agrees_with_the_llama_family_of_the_same_shapes():
    pytest.importorskip("transformers")
    hf = plan_recipe("hf-finetune-demo", [], world_size=4)
    # The shipped folder is an exported text-demo Llama: the same shapes, the built-in family.
    llama = plan_recipe("text-demo", [], world_size=4)
    assert hf.num_params == llama.num_params
    assert [u.path.removeprefix("hf.model.") for u in hf.units] == [u.path for u in llama.units]
    strip = [dataclasses.replace(u, path="") for u in hf.units]
    assert strip == [dataclasses.replace(u, path="") for u in llama.units]
    assert hf.strategies == llama.strategies

    hf_model = load_recipe("hf-finetune-demo", []).config.model
    llama_model = load_recipe("text-demo", []).config.model
    hf_spec, llama_spec = model_spec(hf_model), model_spec(llama_model)
    assert hf_spec.num_params(hf_model) == llama_spec.num_params(llama_model)
    assert hf_spec.flops_per_token(hf_model, 64) == llama_spec.flops_per_token(llama_model, 64)
    shape = hf_spec.shape(hf_model)
    assert (shape.dim, shape.n_layers, shape.n_kv_heads, shape.vocab_size) == (64, 2, 2, 257)


def test_fsdprun_plan_of_an_hf_folder():
    pytest.importorskip("transformers")
    result = CliRunner().invoke(app, ["plan", "hf-finetune-demo", "--world-size", "4"])
    assert result.exit_code == 0, result.output
    assert "hf-finetune-demo: 131.52K params" in result.output


def test_the_built_in_and_hf_models_keep_the_model_contract_and_their_family_entry():
    """`CausalLM` (the typed contract) holds for both families' models, and what each can do
    comes from its `fsdprun.families` entry, the built-in Llama's declared as an HF type's."""
    from fsdprun.config.model_facts import model_facts
    from fsdprun.families import BUILTIN_FAMILIES, HF_FAMILIES, UNDECLARED, family_entry
    from fsdprun.models import CausalLM, build_model

    for cfg, entry in ((ModelConfig(n_layers=2), BUILTIN_FAMILIES["llama"]),
                       (ModelConfig(hf_path=str(HF_DEMO)), HF_FAMILIES["llama"])):  # fmt: skip
        with torch.device("meta"):
            model = build_model(cfg)
        assert isinstance(model, CausalLM), type(model)
        assert model_facts(cfg).entry is entry
        assert model.lora_groups() == entry.lora_groups()
        assert model_spec(cfg).tp_plan(cfg) is entry.tp_plan
        assert len(model.cp_attention_modules(index=0, count=2)) == 2  # both declare cp_attention
        names = dict(model.named_modules())
        assert {*entry.stages.first, entry.stages.blocks, *entry.stages.last} <= set(names)
    assert family_entry("toy") is UNDECLARED and not UNDECLARED.cp_attention


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_model_facts_read_the_rope_either_transformers_writes(tmp_path, key):
    """transformers 5 saves a folder's rope as `rope_parameters`, earlier ones as
    `rope_scaling`: the facts read either (and a plain folder's rope is the default)."""
    import json

    from fsdprun.config.model_facts import model_facts

    rope = {"rope_type": "longrope", "original_max_position_embeddings": 32,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}  # fmt: skip
    config = {**json.loads((HF_DEMO / "config.json").read_text()), key: rope}
    config.pop("rope_scaling" if key == "rope_parameters" else "rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    facts = model_facts(ModelConfig(hf_path=str(tmp_path)))
    assert (facts.rope_type, facts.original_max_position_embeddings) == ("longrope", 32)
    assert model_facts(ModelConfig(hf_path=str(HF_DEMO))).rope_type == "default"
