"""Which parallel layouts compose with which features and model families: every cell of the
table in docs/parallelism.md, computed from the rules that refuse a recipe.

A cell is a layout (a column: `LAYOUTS`) against a feature of the built-in Llama at the debug
recipe's shape (a row: `FEATURES`) or against a HuggingFace family at a tiny shape (a row:
`HF_FAMILIES`, whose config.json is `tiny_config_json`). Its answer is what `fsdprun train` says
of that recipe before anything launches: the cross-field checks (`config.validate`, the layout's
rules of `config.layout` among them, with the model's facts read from config.json by
`config.model_facts`) and the family's capabilities that need no model built (`families.Family`:
a TP plan that is a sentence is a refusal). Accepted ("exact") cells name the test that trains
them against one rank (`TESTS`, checked by tests/test_composition.py); refused ones show the
refusal's own words. A new parallel dimension is one line of `LAYOUTS`, a new feature one line
of `FEATURES`.

`.venv/bin/python scripts/update_docs.py` writes the table into docs/parallelism.md and prints
the share of exact cells. Torch-free, as the rest of `config`: it writes the tiny config.json
files into a temporary folder and reads them as a recipe would.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdprun.config.layout import Layout
from fsdprun.config.load import load_recipe
from fsdprun.config.model_facts import CONFIG_JSON, model_facts
from fsdprun.config.validate import validate
from fsdprun.families import HF_FAMILIES

RECIPE = "debug"
WORLD_SIZE = 4  # every layout below fits it, and the tests' 4-rank gloo group trains them

# Column -> the overrides that make the layout (a pipeline column is one more line). Expert
# parallel shards a mixture of experts: its column's built-in Llama is the debug-moe recipe's
# (8 experts, 2 active, the router's auxiliary loss on); an HF folder's model.moe_* are ignored.
MOE = ("model.moe_experts=8", "model.moe_ffn_dim=64", "model.moe_aux_loss_coef=0.01")
LAYOUTS: dict[str, tuple[str, ...]] = {
    "dp": (),
    "tp 2": ("parallel.tp=2",),
    "cp 2": ("parallel.cp=2",),
    "cp 2 x tp 2": ("parallel.cp=2", "parallel.tp=2"),
    "pp 2": ("parallel.pp=2",),
    "ep 2": ("parallel.ep=2", *MOE),
}

# Row -> the overrides that switch the feature on (the built-in Llama of the debug recipe).
FEATURES: dict[str, tuple[str, ...]] = {
    "compile": ("compile.enabled=true",),
    "float8": ("precision.float8=tensorwise",),
    "LoRA": ("lora.rank=8",),
    "full checkpointing": ("activation_checkpointing.mode=full",),
    "selective checkpointing": ("activation_checkpointing.mode=selective",),
    "chunked loss": ("train.loss=chunked",),
    # Shard groups of one data-parallel rank, so that a layout of 2 or more data-parallel ranks
    # has replicas to all-reduce over (cp 2 x tp 2 at 4 ranks has one: a replica dim of 1).
    "hybrid sharding": ("fsdp.sharding=hybrid", "fsdp.shard_group_size=1"),
    "cpu_offload": ("fsdp.cpu_offload=true",),
}

# The families' tiny shape (tests/hf_families.py makes real folders of it with transformers):
# 2 layers of hidden 64, 4 heads and 2 kv heads of 16, and each family's own features on.
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# model_type -> what its tiny config sets beyond TINY_CONFIG.
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 16},
    # Gemma ties its embedding and output (transformers' default for the family, which
    # save_pretrained writes out).
    "gemma2": {"sliding_window": 16, "tie_word_embeddings": True},
    "gemma3_text": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                    "tie_word_embeddings": True},
    "phi3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}  # fmt: skip

# Each exact cell -> the test that trains it (`fsdprun train`, or the worker's own training
# path in the tests' gloo groups) against one rank, as a pytest node id.
_COVER = "tests/test_composition.py::test_covering_set_trains_as_one_rank"
_CP, _TP, _PP = "tests/test_cp.py", "tests/test_tp.py", "tests/test_pp.py"
_EP = "tests/test_ep.py"
_COMPILED_CP = f"{_CP}::test_compiled_blocks_under_cp_and_tp_train_as_the_compiled_one_rank_run"
_FAMILIES = "tests/test_hf_families.py::test_training_equals_transformers_on_1_and_2_ranks"
TESTS: dict[tuple[str, str], str] = {
    ("dp", "compile"): _COMPILED_CP,
    ("dp", "float8"): "tests/test_float8.py::"
    "test_float8_trains_on_cpu_ranks_with_and_without_float8_all_gather",
    ("dp", "LoRA"): f"{_COVER}[dp-lora-full]",
    ("dp", "full checkpointing"): f"{_COVER}[dp-lora-full]",
    ("dp", "selective checkpointing"): f"{_COVER}[dp-selective-chunked-hybrid-offload]",
    ("dp", "chunked loss"): f"{_COVER}[dp-selective-chunked-hybrid-offload]",
    ("dp", "hybrid sharding"): f"{_COVER}[dp-selective-chunked-hybrid-offload]",
    ("dp", "cpu_offload"): f"{_COVER}[dp-selective-chunked-hybrid-offload]",
    ("tp 2", "compile"): f"{_TP}::test_compiled_tp_blocks_train_as_eager_tp",
    ("tp 2", "full checkpointing"): f"{_TP}::test_tp2_dp2_trains_as_fsdp2_on_4_ranks_and_1_rank",
    ("tp 2", "selective checkpointing"): f"{_COVER}[tp2-selective-hybrid-offload]",
    ("tp 2", "hybrid sharding"): f"{_TP}::"
    "test_chat_rows_with_masked_targets_train_and_evaluate_as_one_rank",
    ("tp 2", "cpu_offload"): f"{_COVER}[tp2-selective-hybrid-offload]",
    ("cp 2", "compile"): _COMPILED_CP,
    ("cp 2", "full checkpointing"): f"{_CP}::test_cp2_dp2_trains_as_dp4_and_one_rank",
    ("cp 2", "selective checkpointing"): f"{_COVER}[cp2-selective-offload]",
    ("cp 2", "chunked loss"): f"{_CP}::"
    "test_packed_chat_rows_with_clipping_and_chunked_loss_train_as_one_rank",
    ("cp 2", "hybrid sharding"): f"{_CP}::"
    "test_packed_chat_rows_with_clipping_and_chunked_loss_train_as_one_rank",
    ("cp 2", "cpu_offload"): f"{_COVER}[cp2-selective-offload]",
    **{("dp", family): f"{_FAMILIES}[{family}]" for family in TINY_FAMILIES},
    ("tp 2", "llama"): f"{_TP}::test_hf_folder_tp2_dp2_trains_as_one_rank",
    **{("tp 2", family): f"{_TP}::test_hf_family_tp2_dp2_trains_as_one_rank[{family}]"
       for family in ("gemma3_text", "phi3")},
    **{("tp 2", family): f"{_COVER}[tp2-{family}]"
       for family in ("qwen2", "qwen3", "mistral", "gemma2")},
    ("cp 2", "llama"): f"{_CP}::test_hf_llama_folder_trains_as_one_rank",
    **{("cp 2", family): f"{_CP}::test_every_family_trains_under_cp_as_one_rank"
       f"[{family}-alltoall-synthetic]"
       for family in ("qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "phi3")},
    ("cp 2 x tp 2", "compile"): _COMPILED_CP,
    ("cp 2 x tp 2", "full checkpointing"): f"{_CP}::test_ring_under_tp_trains_as_one_rank",
    ("cp 2 x tp 2", "selective checkpointing"): f"{_COVER}[cp2-tp2-selective-hybrid-offload]",
    ("cp 2 x tp 2", "hybrid sharding"): f"{_COVER}[cp2-tp2-selective-hybrid-offload]",
    ("cp 2 x tp 2", "cpu_offload"): f"{_COVER}[cp2-tp2-selective-hybrid-offload]",
    ("cp 2 x tp 2", "llama"): f"{_CP}::test_ring_under_tp_trains_as_one_rank",
    **{("cp 2 x tp 2", family): f"{_COVER}[cp2-tp2-{family}]"
       for family in ("qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "phi3")},
    **{(layout, "float8"): f"{_TP}::test_float8_under_tp_cp_and_cp_x_tp_trains_as_one_rank_float8"
       for layout in ("tp 2", "cp 2", "cp 2 x tp 2")},
    **{(layout, "LoRA"): "tests/test_hf_families.py::"
       "test_lora_under_tp_and_cp_equals_peft_and_its_exports_load" for layout in ("tp 2", "cp 2")},
    ("cp 2 x tp 2", "LoRA"): f"{_COVER}[cp2-tp2-lora]",
    ("tp 2", "qwen3_moe"): f"{_TP}::test_moe_tp2_dp2_trains_as_one_rank_resumes_and_exports",
    ("pp 2", "compile"): f"{_COVER}[pp2-compile]",
    ("pp 2", "float8"): f"{_PP}::test_float8_under_pp_trains_as_one_rank_float8",
    ("pp 2", "LoRA"): f"{_COVER}[pp2-lora-selective-offload]",
    ("pp 2", "full checkpointing"): f"{_PP}::test_pp2_dp2_trains_as_one_rank",
    ("pp 2", "selective checkpointing"): f"{_COVER}[pp2-lora-selective-offload]",
    ("pp 2", "chunked loss"): f"{_PP}::"
    "test_packed_chat_rows_with_chunked_loss_clipping_and_eval_train_as_one_rank",
    ("pp 2", "hybrid sharding"): f"{_PP}::"
    "test_packed_chat_rows_with_chunked_loss_clipping_and_eval_train_as_one_rank",
    ("pp 2", "cpu_offload"): f"{_COVER}[pp2-lora-selective-offload]",
    ("pp 2", "llama"): f"{_PP}::test_hf_llama_folder_trains_as_one_rank",
    **{("pp 2", family): f"{_COVER}[pp2-{family}]"
       for family in ("qwen2", "qwen3", "qwen3_moe", "mistral", "phi3")},
    ("ep 2", "compile"): f"{_EP}::test_compiled_blocks_train_as_one_rank",
    **{("ep 2", feature): f"{_EP}::test_ep_trains_as_one_rank[debug-moe]"
       for feature in ("full checkpointing", "selective checkpointing", "chunked loss")},
    ("ep 2", "qwen3_moe"): f"{_EP}::test_ep_trains_as_one_rank[qwen3_moe]",
    **{("ep 2", feature): f"{_EP}::test_lora_offload_and_float8_under_ep_train_as_one_rank"
       f"[{test}]" for feature, test in (("LoRA", "lora-offload"), ("cpu_offload", "lora-offload"),
                                         ("float8", "float8"))},
}  # fmt: skip

EXACT = "✓"


@dataclass(frozen=True)
class Cell:
    """One layout against one feature or family: exact (no refusals) or refused, and why."""

    layout: str
    row: str
    refusals: tuple[str, ...]
    test: str | None  # the test that trains an exact cell against one rank (TESTS)

    @property
    def exact(self) -> bool:
        return not self.refusals


def tiny_config_json(model_type: str) -> dict[str, Any]:
    """The tiny config.json of a family of `TINY_FAMILIES` (the keys the rules read)."""
    return {"model_type": model_type, **TINY_CONFIG, **TINY_FAMILIES[model_type]}


def refusals(overrides: tuple[str, ...] | list[str]) -> list[str]:
    """What `fsdprun train RECIPE OVERRIDES --nproc-per-node WORLD_SIZE` refuses before any rank
    starts and without a model built: the recipe's cross-field checks (the layout's rules among
    them) and the family's declared capabilities (a TP plan that is a sentence)."""
    overrides = [*overrides, f"launch.nproc_per_node={WORLD_SIZE}"]
    cfg = load_recipe(RECIPE, overrides, check=False).config
    errors = validate(cfg, world_size=WORLD_SIZE)
    facts = model_facts(cfg.model)
    plan = facts.entry.tp_plan if facts is not None else None
    layout = Layout.of(cfg, WORLD_SIZE)
    if layout.is_tp and isinstance(plan, str) and facts.hf:
        # `engines.tp.tp_plan_problem`'s words, which name the model's class from the built model.
        errors.append(f"parallel.tp={layout.tp}: model.hf_path's {facts.model_type} has "
                      f"no tensor-parallel plan: {plan}; set parallel.tp=1")  # fmt: skip
    return errors


def feature_cells() -> list[Cell]:
    """Every layout against every feature, row by row."""
    return [
        _cell(layout, feature, refusals([*LAYOUTS[layout], *overrides]))
        for feature, overrides in FEATURES.items()
        for layout in LAYOUTS
    ]


def family_cells(configs: dict[str, dict[str, Any]] | None = None) -> list[Cell]:
    """Every layout against every family of `HF_FAMILIES`, from its tiny config.json (or the
    one `configs` gives for it), row by row."""
    cells = []
    with tempfile.TemporaryDirectory(prefix="fsdprun-composition-") as tmp:
        for family in HF_FAMILIES:
            folder = Path(tmp) / family
            folder.mkdir()
            config = (configs or {}).get(family) or tiny_config_json(family)
            (folder / CONFIG_JSON).write_text(json.dumps(config), encoding="utf-8")
            for layout, overrides in LAYOUTS.items():
                found = refusals([*overrides, f"model.hf_path={folder}"])
                # A refusal naming the temporary folder would change with every run.
                found = [e.replace(str(folder), "FOLDER") for e in found]
                cells.append(_cell(layout, family, found))
    return cells


def _cell(layout: str, row: str, found: list[str]) -> Cell:
    return Cell(layout, row, tuple(found), None if found else TESTS.get((layout, row)))


def exact_share(cells: list[Cell], layouts: tuple[str, ...] | None = None) -> tuple[int, int]:
    """(exact cells, cells) among `cells` of `layouts` (default: all)."""
    mine = [c for c in cells if layouts is None or c.layout in layouts]
    return sum(c.exact for c in mine), len(mine)


def composition_table(cells: list[Cell] | None = None) -> str:
    """docs/parallelism.md's generated part: the table (a row per feature, then per family; a
    column per layout), the tests that train its exact cells and the refusals' words, numbered
    once each."""
    cells = cells if cells is not None else feature_cells() + family_cells()
    tests: list[str] = []
    refused: list[str] = []

    def number(items: list[str], item: str) -> int:
        if item not in items:
            items.append(item)
        return items.index(item) + 1

    def mark(cell: Cell) -> str:
        if cell.exact:
            return f"{EXACT} T{number(tests, cell.test or 'no test')}"
        return "refused " + ", ".join(f"R{number(refused, why)}" for why in cell.refusals)

    by_row: dict[str, dict[str, Cell]] = {}
    for cell in cells:
        by_row.setdefault(cell.row, {})[cell.layout] = cell
    layouts = list(dict.fromkeys(c.layout for c in cells))
    lines = [f"| {WORLD_SIZE} ranks | " + " | ".join(layouts) + " |",
             "|---" * (len(layouts) + 1) + "|"]  # fmt: skip
    for row, by_layout in by_row.items():
        name = f"HF `{row}`" if row in HF_FAMILIES else row
        lines.append(f"| {name} | " + " | ".join(mark(by_layout[x]) for x in layouts) + " |")
    counts = [exact_share(cells, (x,)) for x in layouts]
    lines.append("| exact | " + " | ".join(f"{n} of {total}" for n, total in counts) + " |")
    exact, total = exact_share(cells)
    lines += ["", f"{exact} of {total} cells exact ({100 * exact / total:.0f}%).", "",
              "Tests (each trains its cells against one rank):", ""]  # fmt: skip
    lines += [f"- T{i}: `{test}`" for i, test in enumerate(tests, start=1)]
    lines += ["", "Refusals (`fsdprun train` says them before anything starts):", ""]
    lines += [f"- R{i}: {why}" for i, why in enumerate(refused, start=1)]
    return "\n".join(lines) + "\n"
