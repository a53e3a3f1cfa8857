"""The recipe reference: every schema key with its type, default and help text as one Markdown
table. docs/recipes.md embeds it (scripts/update_docs.py) and a test keeps the two equal. And
the built-in recipes' cards for `fsdprun recipes`: where each runs and its parameter count, read
from the recipe itself. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import enum

import yaml

from fsdprun.config import schema
from fsdprun.config.load import builtin_recipes, config_to_dict, load_recipe
from fsdprun.config.schema import DeviceKind, LaunchConfig, RecipeConfig, schema_fields
from fsdprun.config.sizes import model_num_params


def _type_name(f: dataclasses.Field) -> str:
    """A schema field's type as a recipe writer reads it: `int or null`, `enum` (its values are
    listed in the meaning), `list[str]`."""
    # The schema's annotations are strings (`from __future__ import annotations`): look the
    # names up in the schema module to tell the enums.
    parts = [p.strip() for p in str(f.type).split("|")]
    names = ["null" if p == "None" else "enum" if isinstance(vars(schema).get(p), enum.EnumMeta)
             else p for p in parts]  # fmt: skip
    return " or ".join(names)


def recipe_reference() -> str:
    """The recipe reference as a Markdown table (every key, its type, its default, what it
    does); docs/recipes.md embeds it (scripts/update_docs.py) and a test keeps the two equal."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    defaults = config_to_dict(RecipeConfig())
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


def builtin_recipe_cards() -> list[RecipeCard]:
    """The built-in recipes with where they run and their model's parameter count, as resolved
    (an `extends` parent's values included)."""
    cards = []
    for name, description in builtin_recipes().items():
        cfg = load_recipe(name, [], check=False).config
        cards.append(RecipeCard(name, runs_on(cfg.launch), model_num_params(cfg.model),
                                description))  # fmt: skip
    return cards
