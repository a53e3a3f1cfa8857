"""FSDP unit planning and init on a meta-device model (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from fsdprun.config import FsdpConfig, WrapPolicy, load_recipe
from fsdprun.engines.units import plan_units
from fsdprun.engines.weights import init_weights
from fsdprun.errors import UserError
from fsdprun.models.llama import Transformer, build_model_args


def meta_model(*overrides: str) -> Transformer:
    args = build_model_args(load_recipe("debug", list(overrides)).config.model)
    with torch.device("meta"):
        return Transformer(args)


def test_block_policy_wraps_each_block():
    assert plan_units(meta_model(), cfg=FsdpConfig()) == ["layers.0", "layers.1"]


def test_classes_policy_and_tied_embeddings():
    cfg = FsdpConfig(wrap=WrapPolicy.classes, wrap_classes=["FeedForward", "Embedding", "Linear"])
    units = plan_units(meta_model("model.tie_embeddings=true"), cfg=cfg)
    assert "layers.0.feed_forward" in units and "layers.1.attention.wq" in units
    # The tied embedding/output weight may belong to one unit only: neither is wrapped alone.
    assert "tok_embeddings" not in units and "output" not in units
    untied = plan_units(meta_model(), cfg=cfg)
    assert "tok_embeddings" in untied and "output" in untied


def test_classes_policy_unknown_class_names_the_choices():
    cfg = FsdpConfig(wrap=WrapPolicy.classes, wrap_classes=["DecoderLayer"])
    with pytest.raises(UserError, match="DecoderLayer not in this model; its classes are .*"
                       "TransformerBlock"):  # fmt: skip
        plan_units(meta_model(), cfg=cfg)


def test_size_policy_is_post_order():
    cfg = FsdpConfig(wrap=WrapPolicy.size, min_num_params=40_000)
    assert plan_units(meta_model(), cfg=cfg) == ["layers.0", "layers.1"]
    cfg = FsdpConfig(wrap=WrapPolicy.size, min_num_params=20_000)
    assert plan_units(meta_model(), cfg=cfg) == ["layers.0.feed_forward", "layers.1.feed_forward"]


def test_init_is_deterministic_and_per_parameter():
    a, b = meta_model(), meta_model()
    init_weights(a, seed=1, device=torch.device("cpu"))
    init_weights(b, seed=1, device=torch.device("cpu"))
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.equal(q), name
    assert a.layers["0"].attention_norm.weight.eq(1).all()
    wq = a.layers["0"].attention.wq.weight
    assert 0.015 < wq.std().item() < 0.025
    assert not wq.equal(a.layers["1"].attention.wq.weight)
    assert a.rope.isfinite().all()
