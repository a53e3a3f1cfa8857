"""Import rules of the package layout, read from the source files (nothing is imported).

Each rule is what a module's opening docstring promises: the ground floor (errors, the number
formats, device, the run directory's names and lock, the loss functions, the family names) imports
nothing of fsdprun above it, so every package may import it; config never imports torch, models nor
the packages that run training, models never import torch.distributed, report never imports the
engines, the training loop nor the launcher, checkpoint never imports the training loop nor the
launcher (and reads a checkpoint folder without torch), data never imports engines, train, launch
or models, tools read and never run and engines never drive (no training loop, no launcher), launch
builds nothing itself (no models, no engines), neither fsdprun modules nor its packages import each
other in a circle at load time, and inside one package no two modules name each other in a circle
by any import (at load time, inside a function, or for types only). The "never imports" rules are
one table, `NEVER_IMPORTS`, which docs/architecture.md draws.
A rule that another area still breaks is marked xfail(strict=True) naming that area: it turns
into a failure the day it passes, so the mark comes off then. Run with
`pytest tests/test_imports.py`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fsdprun"

# The package's ground floor: modules every package may import (they import only one another).
GROUND_FLOOR = (
    "fsdprun.errors", "fsdprun.fmt", "fsdprun.device", "fsdprun.rundir", "fsdprun.runlock",
    "fsdprun.loss", "fsdprun.families", "fsdprun.children", "fsdprun.loopback",
)  # fmt: skip

# Imports that config may make inside a function, with the reason; all others are at load time.
CONFIG_LAZY_IMPORTS = {
    # Resolving launch.device=auto needs torch, asked only where /dev has accelerator nodes.
    "fsdprun.device": "resolves launch.device=auto on a machine with accelerators",
    # A recipe naming a Hub id (config.hub) looks it up in the cache, or downloads it.
    "huggingface_hub": "resolves a Hub id in model.hf_path or data.tokenizer",
    "huggingface_hub.constants": "the cache folder and offline mode in a Hub id's messages",
    "huggingface_hub.errors": "a Hub id's gated, unknown or unreachable model as one line",
}

# What each room never imports, at any level: the rules its opening docstring states, drawn in
# docs/architecture.md's table (tests/test_architecture.py holds the two alike). A key is a
# room (a package, or a top-level module); a bare name in the tuple is an fsdprun room, a dotted
# outside name a module of another package.
NEVER_IMPORTS = {
    "config": ("torch", "data", "engines", "train", "launch", "models"),
    "models": ("torch.distributed",),
    "data": ("engines", "train", "launch", "models"),
    "report": ("engines", "train", "launch"),
    "checkpoint": ("train", "launch"),
    "engines": ("train", "launch"),
    "tools": ("train", "launch"),
    "launch": ("models", "engines"),
    # The torch-free ground floor: `fsdprun status`, the launcher's lock, config's metrics-file
    # default and family check, compare's and tune's children; the open-file limit, checked
    # before anything heavy loads.
    "rundir": ("torch",),
    "runlock": ("torch",),
    "families": ("torch",),
    "children": ("torch",),
    "limits": ("torch",),
}
# The modules a rule above lets a room import all the same, with the reason.
NEVER_IMPORTS_ALLOWED = {
    ("launch", "engines.float8"): "the device check before workers start",
    ("launch", "engines.preflight"): "what the workers' build would refuse, before they start",
}


def forbidden_modules(names: tuple[str, ...]) -> tuple[str, ...]:
    """A rule's names as module names: fsdprun's rooms in full, outside modules as they are."""
    return tuple(f"fsdprun.{n}" if f"fsdprun.{n}" in modules() else n for n in names)


@dataclass
class Imports:
    """What one module imports: at load time (module level, outside `if TYPE_CHECKING:`),
    inside functions, and for types only (inside `if TYPE_CHECKING:`, which never runs)."""

    at_load: set[str] = field(default_factory=set)
    in_functions: set[str] = field(default_factory=set)
    for_types: set[str] = field(default_factory=set)

    @property
    def all(self) -> set[str]:
        """What runs: at load time and inside functions."""
        return self.at_load | self.in_functions

    @property
    def named(self) -> set[str]:
        """Every module the file names in an import, the type-only ones too."""
        return self.all | self.for_types


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The modules an import statement loads: `from a.b import c` loads a.b.c when that is a
    module of the package, else a.b."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert not node.level, f"{importer}: a relative import; the package spells imports out"
    base = node.module or ""
    found = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules()]
    return found or [base]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def imports_of(module: str) -> Imports:
    result = Imports()

    def visit(node: ast.AST, found: set[str]) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                visit(child, result.for_types)
            for child in node.orelse:  # only the else branch runs
                visit(child, found)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(_targets(node, module))
        if found is result.at_load and isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        ):
            found = result.in_functions
        for child in ast.iter_child_nodes(node):
            visit(child, found)

    visit(ast.parse(modules()[module].read_text()), result.at_load)
    return result


def _with_packages(target: str, importer: str) -> list[str]:
    """A module and the packages Python initializes to import it (fsdprun.a.b runs fsdprun.a's
    __init__ first), less the importer's own packages, which are already loading."""
    parts = target.split(".")
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [m for m in chain if m in modules() and (m == target or m not in own)]


@cache
def load_graph() -> dict[str, set[str]]:
    """fsdprun module -> the fsdprun modules that loading it loads directly."""
    graph = {}
    for module in modules():
        edges = set()
        for target in imports_of(module).at_load:
            if target.split(".")[0] == "fsdprun":
                edges.update(_with_packages(target, module))
        graph[module] = edges - {module}
    return graph


def loaded_by(starts: set[str]) -> tuple[set[str], set[str], dict[str, str]]:
    """Everything loading `starts` loads: (fsdprun modules, outside top-level packages, and for
    each a module that imports it, to print the path)."""
    seen, outside, via = set(), set(), {}
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for target in imports_of(module).at_load:
            root = target.split(".")[0]
            if root != "fsdprun":
                outside.add(root)
                via.setdefault(root, module)
        for target in load_graph()[module] - seen:
            via.setdefault(target, module)
            todo.append(target)
    return seen, outside, via


def path_to(name: str, via: dict[str, str]) -> str:
    chain = [name]
    while chain[-1] in via and via[chain[-1]] not in chain:
        chain.append(via[chain[-1]])
    return " <- ".join(chain)


def area(name: str) -> list[str]:
    return [m for m in modules() if m == f"fsdprun.{name}" or m.startswith(f"fsdprun.{name}.")]


def direct_violations(areas: list[str], forbidden: tuple[str, ...], allowed=()) -> list[str]:
    """`module imports target` for each import, at any level, of a forbidden module."""
    out = []
    for module in areas:
        for target in sorted(imports_of(module).all):
            hit = any(target == f or target.startswith(f + ".") for f in forbidden)
            if hit and target not in allowed:
                out.append(f"{module} imports {target}")
    return out


def test_the_reader_sees_the_imports_it_must():
    # Guards the rules below against reading nothing: known imports of today's files.
    assert "fsdprun.config.schema" in imports_of("fsdprun.config.load").at_load
    assert "fsdprun.device" in imports_of("fsdprun.config.validate").in_functions
    trials = imports_of("fsdprun.tools.tune.trials")
    assert "fsdprun.tools.tune.space" in trials.for_types - trials.all  # Candidate, for types
    assert "torch" in imports_of("fsdprun.device").at_load
    assert "fsdprun.config" in load_graph()["fsdprun.engines.mesh"]  # the package runs first
    assert "fsdprun.config.layout" in imports_of("fsdprun.config.validate").at_load
    assert "fsdprun.config" not in load_graph()["fsdprun.config.load"]  # its own package


@pytest.mark.parametrize("name", sorted(NEVER_IMPORTS))
def test_a_room_never_imports_what_its_rule_names(name):
    allowed = [f"fsdprun.{m}" for (room, m) in NEVER_IMPORTS_ALLOWED if room == name]
    bad = direct_violations(area(name), forbidden_modules(NEVER_IMPORTS[name]), allowed=allowed)
    assert not bad, bad


def test_each_allowed_exception_is_a_module_its_rule_forbids():
    for room, module in NEVER_IMPORTS_ALLOWED:
        assert f"fsdprun.{module}" in modules(), module
        assert module.split(".")[0] in NEVER_IMPORTS[room], (room, module)


def test_config_imports_inside_functions_only_what_it_lists():
    lazy = {t for m in area("config") for t in imports_of(m).in_functions}
    assert lazy <= set(CONFIG_LAZY_IMPORTS), lazy


def test_loading_and_validating_a_recipe_loads_no_torch():
    """Everything loaded by importing config and calling `validate` (which checks the
    layout's rules): no torch, no data/train/launch."""
    starts = set(area("config"))
    for module in area("config"):
        for target in imports_of(module).in_functions - set(CONFIG_LAZY_IMPORTS):
            starts.update(_with_packages(target, module))
    seen, outside, via = loaded_by(starts)
    assert "torch" not in outside, path_to("torch", via)
    heavy = sorted(m for m in seen if m.split(".")[1] in ("data", "train", "launch"))
    assert not heavy, [path_to(m, via) for m in heavy]


def test_the_ground_floor_imports_nothing_above_it():
    """errors, the number formats, device, the run directory's names and lock, the loss and the
    family names import, of fsdprun, only one another (at any level, inside functions too), so
    that every package may import them without a circle."""
    bad = [
        line
        for module in GROUND_FLOOR
        for line in direct_violations([module], ("fsdprun",), allowed=GROUND_FLOOR)
    ]
    assert not bad, bad


def test_reading_a_checkpoint_folder_loads_no_torch():
    """Completeness and inspection (manifest, dcp_metadata, inspect) read DCP's `.metadata`
    with fsdprun's own unpickler: loading them loads no torch, and no saving or loading side
    (the package re-exports those names lazily)."""
    for module in ("checkpoint.dcp_metadata", "checkpoint.manifest", "checkpoint.inspect"):
        seen, outside, via = loaded_by({f"fsdprun.{module}"})
        assert "torch" not in outside, path_to("torch", via)
        heavy = sorted(seen & {"fsdprun.checkpoint.save", "fsdprun.checkpoint.restore"})
        assert not heavy, [path_to(m, via) for m in heavy]


def test_tune_loads_without_torch():
    # tune launches every trial as an `fsdprun train` subprocess: loading it (for the command,
    # and while the trials run) never loads torch; plan is imported when it prunes, and
    # torch's TCPStore by tune.nodes when a multi-node tune starts. Every module of the package.
    tune = {
        m for m in modules() if m == "fsdprun.tools.tune" or m.startswith("fsdprun.tools.tune.")
    }
    assert len(tune) > 1, tune
    _, outside, via = loaded_by(tune)
    assert "torch" not in outside, path_to("torch", via)


def test_limits_import_nothing_heavy():
    # The open-file limit is checked before anything else loads: only the standard library and
    # the error types.
    imported = imports_of("fsdprun.limits").all
    assert {t for t in imported if t.startswith("fsdprun")} == {"fsdprun.errors"}, imported
    assert "torch" not in {t.split(".")[0] for t in imported}, imported


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_itself_in_a_circle_at_load_time():
    cycle = find_cycle(load_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Imports between two modules of one package that close a circle, which another area still has,
# with the reason; the test of circles inside packages ignores them.
MODULE_EDGES_ALLOWED: dict[tuple[str, str], str] = {}


@cache
def inside_graph(allowed=tuple(MODULE_EDGES_ALLOWED)) -> dict[str, set[str]]:
    """fsdprun module -> the modules of its own package (`room`) that it names in any import: at
    load time, inside a function or for types only; less the `allowed` edges."""
    graph = {}
    for module in modules():
        edges = set()
        for target in imports_of(module).named:
            if room(target) == room(module) and target.split(".")[0] == "fsdprun":
                edges.update(t for t in _with_packages(target, module) if room(t) == room(module))
        graph[module] = edges - {module} - {t for (m, t) in allowed if m == module}
    return graph


def test_no_module_names_another_of_its_package_in_a_circle():
    """Inside one package every import counts: one made inside a function (config.validate took
    load_yaml from config.load, which imports validate) or for types only (data.sft named
    data.spec's DataSpec while spec read prepared folders with sft's functions) works only
    because one side waits, and marks a name in the wrong file. The name moves to a module that
    both may import."""
    cycle = find_cycle(inside_graph())
    assert cycle is None, "import circle inside a package: " + " -> ".join(cycle)


def test_each_allowed_module_edge_still_closes_a_circle():
    # An exception that no longer holds comes off the list.
    graph = inside_graph(allowed=())
    for module, target in MODULE_EDGES_ALLOWED:
        assert target in graph[module], (module, target)
        assert find_cycle({m: graph[m] for m in (module, target)}), (module, target)


# Package edges another area still has, with the reason; the package-level test ignores them.
PACKAGE_EDGES_ALLOWED: dict[tuple[str, str], str] = {}


def room(module: str) -> str:
    """The package a module belongs to (fsdprun.config for fsdprun.config.validate), or the
    ground-floor module itself (fsdprun.rundir)."""
    return ".".join(module.split(".")[:2])


def package_graph(allowed=PACKAGE_EDGES_ALLOWED) -> dict[str, set[str]]:
    """fsdprun package -> the other packages that loading any of its modules loads, less the
    `allowed` edges."""
    graph: dict[str, set[str]] = {}
    for module, targets in load_graph().items():
        edges = {room(t) for t in targets if t != "fsdprun"} - {room(module)}
        graph.setdefault(room(module), set()).update(
            t for t in edges if (room(module), t) not in allowed
        )
    return graph


def test_no_package_imports_another_in_a_circle_at_load_time():
    """Module by module there may be no circle while the packages still form one: config.validate
    loaded fsdprun.models (its __init__) and models.lora loads fsdprun.config, yet the __init__ of
    models never loads lora, so the module graph had no cycle. A package is one room: its modules
    load one another freely, the rooms one another in one direction only."""
    assert "fsdprun.config" in package_graph()["fsdprun.models"]  # models.lora reads LoraConfig
    cycle = find_cycle(package_graph())
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_each_allowed_package_edge_still_exists():
    # An exception that no longer holds comes off the list.
    graph = package_graph(allowed={})
    gone = [edge for edge in PACKAGE_EDGES_ALLOWED if edge[1] not in graph[edge[0]]]
    assert not gone, gone


def test_launch_killed_loads_no_torch():
    # It describes a dead worker from files; the plan it quotes is imported only then.
    seen, outside, via = loaded_by({"fsdprun.launch.killed"})
    assert "torch" not in outside, path_to("torch", via)


# A module reads in one sitting; the two that are one long table each (every command's
# options, every recipe key's dataclass and help) may be longer.
MAX_MODULE_LINES = 800
LONG_MODULES_ALLOWED = {"fsdprun.cli", "fsdprun.config.schema"}


def test_no_module_is_longer_than_one_sitting():
    lines = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    over = {name: n for name, n in lines.items()
            if n > MAX_MODULE_LINES and name not in LONG_MODULES_ALLOWED}  # fmt: skip
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by what they own): {over}"
