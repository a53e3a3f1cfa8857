"""The recipe reference: every schema key with its type, default and help text as one Markdown
table. docs/recipes.md embeds it (scripts/update_docs.py) and a test keeps the two equal. Never
imports torch.
"""

from __future__ import annotations

import dataclasses
import enum

import yaml

from fsdprun.config import schema
from fsdprun.config.load import config_to_dict
from fsdprun.config.schema import RecipeConfig, schema_fields


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
