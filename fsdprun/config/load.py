"""Reading recipes: YAML files read as plain data (`plain_yaml`), `extends:` layers,
`key=value` / `~key` overrides, the merge into one `RecipeConfig`, and where each value came
from (`explain`).

`load_recipe("debug", ["optim.lr=1e-3"])` resolves the layers in order (schema defaults, each
`extends:` parent, the file, the overrides), checks every key against the schema (OmegaConf
structured configs do the type and enum checks), runs `validate`, and returns one
`ResolvedRecipe`. Every mistake raises `UserError` with one line naming the key, the layer that
set it and what would be valid. Never imports torch, nor fsdprun.data/engines/train/launch.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdprun.config.hub import hub_folder, is_hub_id
from fsdprun.config.plain_yaml import NotPlainData, load_yaml
from fsdprun.config.schema import (
    AUTO,
    SECTIONS,
    RecipeConfig,
    auto_keys,
    from_auto,
    schema_fields,
    to_auto,
)
from fsdprun.config.validate import validate
from fsdprun.errors import UserError

DEFAULT_SOURCE = "default"
CLI_SOURCE = "command line"


# Recipe spellings that cannot be Python field names.
ALIASES = {"checkpoint.async": "checkpoint.async_save"}


def _closest(key: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not match:
        # A misspelt leaf in the right section is the common case: compare leaf names there.
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        leaf_match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        match = [by_leaf[leaf_match[0]]] if leaf_match else []
    return f"; did you mean '{match[0]}'?" if match else ""


# --------------------------------------------------------------------------------------------
# Reading recipe files


@dataclass
class Layer:
    """One layer of a recipe: where it came from and its keys (dotted) and values."""

    source: str
    values: dict[str, Any]


@dataclass
class ResolvedRecipe:
    config: RecipeConfig
    name: str
    layers: list[Layer]
    provenance: dict[str, str]

    def to_yaml(self) -> str:
        return dump_config(self.config)


def builtin_recipes() -> dict[str, str]:
    """Built-in recipe names → what each is for: the first sentence of its opening comment (after
    the line with the command that runs it), whole however many lines it takes."""
    out = {}
    for entry in sorted(resources.files("fsdprun.recipes").iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".yaml"):
            out[entry.name[: -len(".yaml")]] = _first_sentence(entry.read_text())
    return out


def _first_sentence(text: str) -> str:
    words: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        line = line.lstrip("# ").strip()
        if line.startswith("fsdprun ") and not words:
            continue
        if line.startswith("Made with:"):
            break
        words += line.split()
    for i, word in enumerate(words):
        # A sentence ends at a full stop closing a word (not `e.g.`, not a file name's dot).
        if word.endswith(".") and word not in ("e.g.", "i.e.", "etc."):
            return " ".join(words[: i + 1])
    return " ".join(words)


def _builtin_text(name: str) -> str | None:
    entry = resources.files("fsdprun.recipes") / f"{name}.yaml"
    return entry.read_text() if entry.is_file() else None


def _read_yaml(text: str, source: str) -> dict[str, Any]:
    try:
        data = load_yaml(text)
    except NotPlainData as e:
        mark = e.problem_mark
        raise UserError(f"{source}: line {mark.line + 1}: {e.problem}") from e
    except ValueError as e:
        raise UserError(f"{source}: unreadable value ({str(e).split(':')[0]})") from e
    except yaml.constructor.ConstructorError as e:
        mark = e.problem_mark
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(
            f"{source}:{where}: YAML tag not allowed ({e.problem}); a recipe is plain data"
        ) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{source}:{where}: YAML syntax error: {problem}") from e
    if data is None:
        raise UserError(f"{source}: the recipe is empty; it needs at least one section")
    if not isinstance(data, dict):
        raise UserError(
            f"{source}: a recipe must be a mapping of sections (model:, train:, ...), "
            f"not a {type(data).__name__}"
        )
    return data


def _flatten(data: dict[str, Any], source: str) -> dict[str, Any]:
    fields = schema_fields()
    flat: dict[str, Any] = {}
    for section, body in data.items():
        section = str(section)
        if section not in SECTIONS:
            raise UserError(
                f"{source}: unknown section '{section}'{_closest(section, list(SECTIONS))}"
            )
        if body is None:
            continue
        if not isinstance(body, dict):
            raise UserError(f"{source}: '{section}' must be a mapping of keys, not {body!r}")
        for key, value in body.items():
            dotted = f"{section}.{key}"
            dotted = ALIASES.get(dotted, dotted)
            if dotted not in fields:
                raise UserError(f"{source}: unknown key '{dotted}'{_closest(dotted, list(fields))}")
            _check_plain(dotted, value, source)
            _check_interpolation(dotted, value, source)
            flat[dotted] = from_auto(dotted, value)
    return flat


def _check_plain(key: str, value: Any, source: str) -> None:
    """A recipe value is a plain value or a flat list of them: refusing a container inside a
    container here keeps a deep nest away from OmegaConf, which recurses through it."""
    if isinstance(value, list | dict):
        items = value.values() if isinstance(value, dict) else value
        if schema_fields()[key].type.startswith("dict[str, list[") and isinstance(value, dict):
            # A mapping of flat lists (tune.space: knob -> values): one level deeper, no more.
            items = [x for v in items for x in (v if isinstance(v, list) else [v])]
        inner = next((v for v in items if isinstance(v, list | dict)), None)
        if inner is not None:
            raise UserError(
                f"{source}: {key}: a {type(inner).__name__} inside a {type(value).__name__} is "
                "not a recipe value; give a plain value or a flat list"
            )
        # OmegaConf cannot merge a list into a mapping or back (a bare TypeError).
        container = schema_fields()[key].type.partition("[")[0]
        if container in ("list", "dict") and type(value).__name__ != container:
            expected = "a list such as [a, b]" if container == "list" else "a mapping {k: v}"
            raise UserError(
                f"{source}: {key}: a {type(value).__name__} is not valid; give {expected}"
            )


# Plain references such as ${train.seq_len} are allowed; resolver calls such as ${oc.env:X}
# are not: a recipe is data and must not read the environment or run code.
_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")


def _check_interpolation(key: str, value: Any, source: str) -> None:
    if isinstance(value, list | dict):
        for item in value.values() if isinstance(value, dict) else value:
            _check_interpolation(key, item, source)
        return
    if not isinstance(value, str):
        return
    for ref in _INTERPOLATION.findall(value):
        if ref not in schema_fields():
            raise UserError(
                f"{source}: {key}: '${{{ref}}}' is not allowed; only references to other "
                f"recipe keys such as ${{train.seq_len}} are"
            )


def _resolve_path(ref: str, base: Path | None) -> tuple[str, str]:
    """A recipe reference → (identity, text). Files win over built-in names."""
    # A parent is looked up beside the recipe that extends it (never in the working directory).
    path = base / ref if base is not None else Path(ref)
    if path.is_file():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read the recipe: {e.strerror}") from e
        try:
            return str(path.resolve()), data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise UserError(
                f"{path}: line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the "
                "recipe as UTF-8"
            ) from e
    name = ref[:-5] if ref.endswith(".yaml") else ref
    text = _builtin_text(name) if "/" not in ref else None
    if text is not None:
        return f"builtin:{name}", text
    names = list(builtin_recipes())
    # A misspelt built-in name (`debugg`) is the common case: suggest the nearest, as for keys.
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.6) if "/" not in ref else []
    hint = f"; did you mean '{match[0]}'?" if match else ""
    raise UserError(
        f"recipe '{ref}' is neither a file nor a built-in recipe{hint} (built-ins: "
        f"{', '.join(names)})"
    )


# Keys holding file paths: a relative path means relative to the recipe file that set it, so a
# recipe and its data can move together (and built-in recipes find the data shipped beside them).
PATH_KEYS = (
    "data.paths", "data.val_paths", "data.tokenizer", "model.hf_path", "compile.cache_dir",
)  # fmt: skip
# Keys that may name a Hugging Face Hub id instead (fsdprun.config.hub).
HUB_KEYS = ("model.hf_path", "data.tokenizer")


def _resolve_paths(values: dict[str, Any], base: Path) -> None:
    """Make the relative paths among `values` absolute against `base`, in place."""

    def resolve(key: str, item: Any) -> Any:
        if not isinstance(item, str) or not item or "${" in item:
            return item
        if key == "data.tokenizer" and item == "byte":
            return item
        if key in HUB_KEYS and is_hub_id(item, base):
            return item  # a Hub id, resolved to its cached snapshot once the layers are merged
        return str((base / Path(item).expanduser()).resolve())

    for key in PATH_KEYS:
        if key not in values:
            continue
        value = values[key]
        if key in ("data.paths", "data.val_paths") and isinstance(value, str):
            value = [value]  # one file needs no list brackets
        if isinstance(value, list):
            values[key] = [resolve(key, item) for item in value]
        else:
            values[key] = resolve(key, value)


def _recipe_dir(identity: str) -> Path:
    if identity.startswith("builtin:"):
        return Path(str(resources.files("fsdprun.recipes")))
    return Path(identity).parent


def load_layers(ref: str, base: Path | None, stack: tuple[str, ...]) -> list[Layer]:
    identity, text = _resolve_path(ref, base)
    source = identity if not identity.startswith("builtin:") else identity
    if identity in stack:
        chain = " -> ".join([*stack, identity])
        raise UserError(f"{source}: 'extends' cycle: {chain}; remove one of the links")
    data = _read_yaml(text, source)
    parents = data.pop("extends", None)
    if parents is None:
        parents = []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserError(f"{source}: 'extends' must be a recipe name or path, or a list of them")
    here = Path(identity).parent if not identity.startswith("builtin:") else None
    layers: list[Layer] = []
    for parent in parents:
        try:
            layers += load_layers(parent, here, (*stack, identity))
        except UserError as e:
            if "neither a file nor a built-in" in str(e):
                raise UserError(f"{source}: extends {e}") from e
            raise
    values = _flatten(data, source)
    _resolve_paths(values, _recipe_dir(identity))
    layers.append(Layer(source, values))
    return layers


def parse_overrides(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`key=value` and `~key` strings → (values, keys to drop). Values are parsed as YAML."""
    fields = schema_fields()
    values: dict[str, Any] = {}
    drops: list[str] = []
    for item in overrides:
        if item.startswith("~"):
            key = ALIASES.get(item[1:], item[1:])
            if key not in fields:
                raise UserError(
                    f"override '{item}': unknown key '{key}'{_closest(key, list(fields))}"
                )
            drops.append(key)
            continue
        if "=" not in item:
            raise UserError(
                f"override '{item}' has no '='; write KEY=VALUE (or ~KEY to drop a key)"
            )
        key, raw = item.split("=", 1)
        key = ALIASES.get(key.strip(), key.strip())
        if key not in fields:
            raise UserError(f"override '{item}': unknown key '{key}'{_closest(key, list(fields))}")
        value = from_auto(key, _parse_value(key, raw, fields[key]))
        _check_plain(key, value, CLI_SOURCE)
        _check_interpolation(key, value, CLI_SOURCE)
        values[key] = value
    return values, drops


def _parse_value(key: str, raw: str, f: dataclasses.Field) -> Any:
    """An override's text as YAML (read as recipes are: no anchors, aliases or deep nests),
    except for string keys, which take the text verbatim (so a run dir `2024-01-01` or an
    endpoint `host:30` are not read as a date or a number)."""
    if f.type in ("str", "str | None"):
        return None if f.type == "str | None" and raw in ("null", "~") else raw
    try:
        return load_yaml(raw) if raw.strip() else ""
    except NotPlainData as e:
        raise UserError(f"{CLI_SOURCE}: {key}: {e.problem}") from e
    except ValueError as e:
        raise UserError(f"{CLI_SOURCE}: {key}: unreadable value ({str(e).split(':')[0]})") from e
    except yaml.YAMLError:
        return raw


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        section, leaf = key.split(".", 1)
        out.setdefault(section, {})[leaf] = value
    return out


# Longest value that ${...} references may build (PATH_MAX on Linux): a chain of values that
# each repeat the previous one ten times would otherwise grow ten-fold per key.
MAX_EXPANDED_CHARS = 4096


def _check_expansion(merged: Any) -> None:
    """Refuse a value whose references would expand beyond MAX_EXPANDED_CHARS, measured on the
    unresolved values (nothing is expanded); reference cycles are left to OmegaConf."""
    raw = OmegaConf.to_container(merged, resolve=False, enum_to_str=True)
    sizes: dict[str, int] = {}

    def size(value: Any, stack: tuple[str, ...]) -> int:
        if isinstance(value, list):
            return 2 + sum(size(v, stack) + 2 for v in value)
        if not isinstance(value, str):
            return len(str(value))
        total = len(_INTERPOLATION.sub("", value))
        for ref in _INTERPOLATION.findall(value):
            if ref in stack or ref not in schema_fields():
                continue
            if ref not in sizes:
                section, leaf = ref.split(".")
                sizes[ref] = size(raw[section][leaf], (*stack, ref))
            total += sizes[ref]
        return total

    for key in schema_fields():
        section, leaf = key.split(".")
        value = raw[section][leaf]
        if "${" in str(value) and size(value, (key,)) > MAX_EXPANDED_CHARS:
            raise UserError(
                f"recipe: {key}: its ${{...}} references expand to more than "
                f"{MAX_EXPANDED_CHARS} characters; reference shorter values"
            )


@functools.cache
def _schema_node() -> Any:
    """The schema's structured config, built once per process: building it from the dataclasses
    costs several times what copying it does (`tune` resolves a recipe per candidate)."""
    return OmegaConf.structured(RecipeConfig)


def _merge(layers: list[Layer]) -> RecipeConfig:
    merged = copy.deepcopy(_schema_node())
    for layer in layers:
        try:
            # In place: what OmegaConf.merge does after copying its first argument, which here
            # is already a copy of nobody else's.
            merged.merge_with(_nest(layer.values))
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            msg = str(e).splitlines()[0]
            if key in auto_keys():
                msg += f"; or {AUTO} (null) to let fsdprun decide"
            raise UserError(f"{layer.source}: {key}: {msg}") from e
    _check_expansion(merged)
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise UserError(f"recipe: {key}: {str(e).splitlines()[0]}") from e


def load_recipe(
    recipe: str,
    overrides: list[str] | None = None,
    *,
    world_size: int | None = None,
    check: bool = True,
    hub: str = "cache",
) -> ResolvedRecipe:
    """Resolve a recipe reference plus overrides into a validated config.

    Args:
        recipe: a YAML path or a built-in recipe name.
        overrides: `key=value` / `~key` strings, applied last.
        world_size: the real number of ranks when known (a worker); else launch.* decides.
        check: run the cross-field checks (`validate`); the caller runs them itself if False.
            The data files are not read here: the commands that use them call
            `fsdprun.data.preflight.check_data`.
        hub: how a Hugging Face Hub id in model.hf_path or data.tokenizer becomes a cached
            snapshot folder: `cache` (never the network), `download` (the launcher, once per
            node) or `wait` (a worker waiting for its node's local rank 0); see config.hub.

    Raises:
        UserError: anything wrong with the recipe, one line.
    """
    layers = load_layers(recipe, None, ())
    values, drops = parse_overrides(overrides or [])
    for key in drops:
        for layer in layers:
            layer.values.pop(key, None)
    if values:
        _resolve_paths(values, Path.cwd())
        layers.append(Layer(CLI_SOURCE, values))
    config = _merge(layers)
    provenance = {key: DEFAULT_SOURCE for key in schema_fields()}
    for layer in layers:
        for key in layer.values:
            provenance[key] = layer.source
    for key in HUB_KEYS:
        section, leaf = key.split(".")
        value = getattr(getattr(config, section), leaf)
        if isinstance(value, str) and is_hub_id(value):
            folder = hub_folder(value, key=key, mode=hub, wait_s=config.launch.timeout_s)
            setattr(getattr(config, section), leaf, str(folder))
            provenance[key] = f"{provenance[key]}, Hub id {value}"
    errors = validate(config, world_size=world_size) if check else []
    if errors:
        raise UserError("; ".join(errors))
    name = Path(recipe).stem if recipe.endswith((".yaml", ".yml")) else recipe
    return ResolvedRecipe(config=config, name=name, layers=layers, provenance=provenance)


# --------------------------------------------------------------------------------------------
# Writing


def config_to_dict(cfg: RecipeConfig, *, auto: bool = False) -> dict[str, Any]:
    """Plain nested dict (enums as their values), for YAML, JSON and manifests. `auto`: the
    keys whose null lets fsdprun decide say `auto` (as a recipe writes them; what `fsdprun
    config` prints), not null (as manifests record them)."""

    def plain(key: str, value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, list):
            return [plain(key, v) for v in value]
        return to_auto(key, value) if auto else value

    return {
        s.name: {f.name: plain(f"{s.name}.{f.name}", getattr(getattr(cfg, s.name), f.name))
                 for f in dataclasses.fields(getattr(cfg, s.name))}
        for s in dataclasses.fields(cfg)
    }  # fmt: skip


def dump_config(cfg: RecipeConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg, auto=True), sort_keys=False)


def explain(resolved: ResolvedRecipe) -> str:
    """The resolved recipe as YAML with, after each key, the layer that set it."""
    data = config_to_dict(resolved.config, auto=True)
    lines = []
    for section, body in data.items():
        lines.append(f"{section}:")
        for key, value in body.items():
            text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
            text = text[1:-1]  # drop the braces of the flow mapping
            if isinstance(value, str) and "\n" in value:  # data.template: one line, "\n"s
                quoted = yaml.safe_dump(value, default_style='"', width=10_000).strip()
                text = f"{key}: {quoted}"
            lines.append(f"  {text:<44} # {resolved.provenance[f'{section}.{key}']}")
    return "\n".join(lines) + "\n"
