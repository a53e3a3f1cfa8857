"""The recipe reference: every schema key with its type, default and help text as one Markdown
table. docs/recipes.md embeds it (scripts/update_docs.py) and a test keeps the two equal. And
the built-in recipes' cards for `fsdprun recipes`: where each runs and its parameter count, read
from the few keys a card shows in the recipe's layers, without merging them. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

import yaml

from fsdprun.config import schema
from fsdprun.config.load import builtin_recipes, config_to_dict, load_layers, load_recipe
from fsdprun.config.model_facts import model_facts
from fsdprun.config.schema import (
    DeviceKind,
    LaunchConfig,
    ModelConfig,
    RecipeConfig,
    schema_fields,
)
from fsdprun.config.sizes import config_num_params, model_num_params


def _type_name(f: dataclasses.Field) -> str:
    """A schema field's type as a recipe writer reads it: `int or null`, `enum` (its values are
    listed in the meaning), `list[str]`."""
    # The schema's annotations are strings (`from __future__ import annotations`): look the
    # names up in the schema module to tell the enums.
    parts = [p.strip() for p in str(f.type).split("|")]
    names = ["null" if p == "None" else "enum" if isinstance(vars(schema).get(p), enum.EnumMeta)
             else p for p in parts]  # fmt: skip
    if f.metadata.get("auto"):  # null, also spelt `auto` (schema.AUTO)
        return f"{', '.join(n for n in names if n != 'null')}, {schema.AUTO} or null"
    return " or ".join(names)


def recipe_reference() -> str:
    """The recipe reference as a Markdown table (every key, its type, its default, what it
    does); docs/recipes.md embeds it (scripts/update_docs.py) and a test keeps the two equal."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    defaults = config_to_dict(RecipeConfig(), auto=True)
    for key, f in schema_fields().items():
        section, leaf = key.split(".")
        default = defaults[section][leaf]
        # A multi-line default (data.template) in double quotes, so "\n" keeps it on one row.
        style = '"' if isinstance(default, str) and "\n" in default else None
        text = yaml.safe_dump(default, default_flow_style=True, default_style=style)
        text = text.strip().removesuffix("...").strip()
        choices = ""
        if isinstance(f.default, enum.Enum):
            choices = " One of: " + ", ".join(f"`{m.value}`" for m in type(f.default)) + "."
        rows.append(f"| `{key}` | {_type_name(f)} | `{text}` | {f.metadata['help']}{choices} |")
    return "\n".join(rows) + "\n"


@dataclasses.dataclass(frozen=True)
class RecipeCard:
    name: str
    runs_on: str  # "2 CPU ranks", "1 GPU", "4 nodes x 8 GPUs"
    num_params: int | None  # None: a model folder that cannot be read here
    description: str


def runs_on(launch: LaunchConfig) -> str:
    """Where a recipe's launch.* runs it: CPU, GPU (accelerator) or either, how many, nodes."""
    kind = {DeviceKind.cpu: "CPU rank", DeviceKind.auto: "rank"}.get(launch.device, "GPU")
    n = launch.nproc_per_node
    per_node = f"{n} {kind}{'s' if n > 1 else ''}"
    return per_node if launch.nnodes == 1 else f"{launch.nnodes} nodes x {per_node}"


# What a card shows or counts with: where the recipe runs, and its model's shape or folder.
CARD_KEYS = (
    "launch.device", "launch.nproc_per_node", "launch.nnodes", "model.dim", "model.n_layers",
    "model.n_heads", "model.n_kv_heads", "model.ffn_dim", "model.vocab_size",
    "model.tie_embeddings", "model.hf_path", "model.moe_experts", "model.moe_ffn_dim",
    "model.moe_shared_ffn_dim",
)  # fmt: skip


def _as_merged(key: str, value: Any) -> bool:
    """Whether a layer's `value` for `key` is already what the merge would make of it: a plain
    value of the field's type, no `${...}` reference, a model folder's path and not a Hub id."""
    kind = schema_fields()[key].type
    if value is None:
        return kind.endswith("| None")
    if isinstance(value, str) and "${" in value:
        return False
    if kind in ("int", "int | None"):
        return type(value) is int  # not a bool, nor "2" or 2.0 that the merge would convert
    if kind == "bool":
        return type(value) is bool
    if kind == "DeviceKind":
        return value in {d.value for d in DeviceKind}
    # model.hf_path: the layers made a folder's path absolute; a Hub id (ORG/NAME) stays as
    # written until the merged recipe resolves it to its cached snapshot.
    return kind == "str | None" and isinstance(value, str) and Path(value).is_absolute()


def recipe_card(recipe: str, description: str) -> RecipeCard:
    """A recipe's card, its keys read from its layers as plain YAML (an `extends:` parent's
    values included, the later layer winning as in the merge) over the schema's defaults.

    Merging every built-in recipe through OmegaConf, only to read a dozen keys, took about half
    of `fsdprun recipes` (0.2 of 0.45 CPU s, 2026-12) and grew with each recipe added. A recipe
    whose card keys are not all plain values (a `${...}` reference, a string the schema would
    convert, a Hub id) is merged as `fsdprun config` merges it, so a card shows the same
    figures either way; a test compares the two for every built-in recipe.
    """
    values: dict[str, Any] = {}
    for layer in load_layers(recipe, None, ()):
        values.update((k, v) for k, v in layer.values.items() if k in CARD_KEYS)
    if all(_as_merged(k, v) for k, v in values.items()):
        leaves: dict[str, dict[str, Any]] = {"model": {}, "launch": {}}
        for key, value in values.items():
            section, leaf = key.split(".")
            leaves[section][leaf] = DeviceKind(value) if key == "launch.device" else value
        model, launch = ModelConfig(**leaves["model"]), LaunchConfig(**leaves["launch"])
    else:
        cfg = load_recipe(recipe, [], check=False).config
        model, launch = cfg.model, cfg.launch
    # A folder without weights (a recipe that initializes at random): counted from config.json.
    count = model_num_params(model)
    if count is None and model.hf_path is not None:
        count = config_num_params(model_facts(model))
    return RecipeCard(recipe, runs_on(launch), count, description)


def builtin_recipe_cards() -> list[RecipeCard]:
    """The built-in recipes with where they run and their model's parameter count, as resolved
    (an `extends` parent's values included)."""
    return [recipe_card(name, description) for name, description in builtin_recipes().items()]
