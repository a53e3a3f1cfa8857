"""YAML read as plain data, the way recipes and `key=value` overrides are read: `load_yaml`.

PyYAML's safe loader without anchors and aliases, with bounded nesting, and with only true and
false as booleans (YAML 1.2's rule). `config.load` reads recipe files and overrides with it and
`config.validate` reads the values of a tuning space with it, so both import it from here.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

# A recipe is a few screens of plain data: section, key, value, at most a list of values.
MAX_YAML_DEPTH = 8


class NotPlainData(yaml.MarkedYAMLError):
    """YAML that a recipe refuses although it parses: anchors, aliases, deep nesting."""


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader without anchors and aliases (`&name`, `*name`) and with bounded
    nesting. Nine levels of ten aliases each are 485 bytes of text that expand to 10^9 values
    once merged; a recipe reuses values with `extends:` or `${key}` references instead. The
    composer is recursive: the depth bound keeps a deep nest from exhausting the stack."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise NotPlainData(
                problem="YAML anchors and aliases (&name, *name) are not allowed; a recipe is "
                "plain data (reuse values with `extends:` or ${section.key} references)",
                problem_mark=event.start_mark,
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise NotPlainData(
                problem=f"nested deeper than {MAX_YAML_DEPTH} levels; a recipe value is a plain "
                "value or a list of them",
                problem_mark=event.start_mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


# YAML 1.1 reads yes/no/on/off (any case) as booleans, so `precision.float8: off`, a value of
# that enum, became False and was refused. Here only true and false are booleans, as in YAML
# 1.2; a boolean key still takes yes/no/on/off (the schema converts those strings).
_BOOL = "tag:yaml.org,2002:bool"
RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    """YAML text as Python data, the way recipes and overrides are read (see `RecipeLoader`).

    Raises:
        yaml.YAMLError: not YAML, a tag other than the standard ones, an anchor, an alias, too
            deep.
        ValueError: a value Python refuses to convert (an integer of more than 4300 digits).
    """
    return yaml.load(text, Loader=RecipeLoader)  # a SafeLoader: no object construction
