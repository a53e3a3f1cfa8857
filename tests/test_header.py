"""The run header says what is trained: where the weights come from, LoRA's settings and the
trainable share, the data and its counts, and where the trackers write. Rendered to a recording
80-column console from `start` events; the same lines on real runs are asserted where those runs
are launched anyway (test_train, test_lora, test_hf, test_sft_loss, test_trackers).

Run with `pytest tests/test_header.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from test_launch import _events

from fsdprun.config import load_recipe
from fsdprun.report.console import Reporter
from fsdprun.report.trackers import describe_trackers
from fsdprun.train.worker import _describe_weights


def _header(start: dict) -> str:
    """The header of a `start` event at 80 columns, its wrapped lines joined again."""
    console = Console(record=True, width=80, highlight=False)
    Reporter(console, live=False).handle(start)
    return " ".join(console.export_text().split())


def test_header_says_what_is_trained_where_it_comes_from_and_where_it_goes():
    plain = _header({**_events()[0], "weights": "random init (train.seed=0)",
                     "num_trainable_params": 131_000, "lora": None, "trackers": []})  # fmt: skip
    assert "weights: random init (train.seed=0)" in plain
    assert "LoRA" not in plain and "trackers:" not in plain
    lora = {"rank": 8, "alpha": 16.0, "dropout": 0.05, "targets": ["q_proj", "v_proj"],
            "num_modules": 4}  # fmt: skip
    run = Path("runs/x")
    trackers = describe_trackers(run, tensorboard=True, wandb={"mode": "online", "project": "p"})
    text = _header({
        **_events()[0], "weights": "pretrained, read from models/tiny-llama-hf",
        "num_trainable_params": 2_048, "lora": lora, "trackers": trackers,
        "data": "chat: 1 file(s): 108 examples; 68 rows", "val_data": "chat: 12 examples",
    })  # fmt: skip
    assert "weights: pretrained, read from models/tiny-llama-hf" in text
    # 2,048 adapter parameters of 131,000 + 2,048 in all.
    assert ("LoRA: rank 8, alpha 16 (scale 2), dropout 0.05, on 4 Linears (q_proj, v_proj); "
            "trainable 2.05K of 133.05K params (1.54%)") in text  # fmt: skip
    assert "data: chat: 1 file(s): 108 examples; 68 rows; validation: chat: 12 examples" in text
    assert ("trackers: TensorBoard -> runs/x/tensorboard/; W&B online run x -> runs/x/wandb/ "
            "and project p") in text  # fmt: skip
    assert describe_trackers(run, tensorboard=False, wandb={"name": "a"}) == [
        "W&B offline run a -> runs/x/wandb/"
    ]
    assert describe_trackers(run, tensorboard=False, wandb={"mode": "disabled"}) == [
        "W&B disabled (output.wandb.mode)"
    ]
    assert describe_trackers(run, tensorboard=False, wandb=None) == []


@pytest.mark.parametrize(
    "recipe,overrides,resumed,words",
    [
        ("debug", [], False, "random init (train.seed=0)"),
        ("debug", ["train.seed=3"], True, "resumed from CKPT"),
        ("hf-finetune-demo", [], False, "pretrained, read from HF"),
        ("hf-finetune-demo", ["model.init=random"], False,
         "random init (model.init=random, train.seed=0)"),
        ("lora-demo", [], True, "pretrained, read from HF; adapters resumed from CKPT"),
        ("debug", ["checkpoint.load_from=base/step-4"], False,
         "loaded from base/step-4 (checkpoint.load_from)"),
    ],
)  # fmt: skip
def test_header_names_where_the_weights_come_from(recipe, overrides, resumed, words):
    cfg = load_recipe(recipe, overrides).config
    ckpt = Path("runs/a/checkpoints/step-00000004")
    got = _describe_weights(cfg, ckpt if resumed else None)
    assert got == words.replace("CKPT", str(ckpt)).replace("HF", str(cfg.model.hf_path))
