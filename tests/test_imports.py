"""Import rules of the package layout, read from the source files (nothing is imported).

Each rule is what a module's opening docstring promises: config never imports torch nor the
packages that run training, models never import torch.distributed, report never imports the
engines or the training loop, checkpoint never imports the training loop nor the launcher (and
reads a checkpoint folder without torch), data
never imports engines, train, launch or models, tools read and never run (no training loop, no
launcher), launch builds nothing itself (no models, no engines), and no fsdprun modules import
each other in a circle at load time.
A rule that another area still breaks is marked xfail(strict=True) naming that area: it turns
into a failure the day it passes, so the mark comes off then. Run with
`pytest tests/test_imports.py`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdprun"

# Imports that config may make inside a function, with the reason; all others are at load time.
CONFIG_LAZY_IMPORTS = {
    # Resolving launch.device=auto needs torch, asked only where /dev has accelerator nodes.
    "fsdprun.device": "resolves launch.device=auto on a machine with accelerators",
}


@dataclass
class Imports:
    """What one module imports: at load time (module level, outside `if TYPE_CHECKING:`) and
    inside functions."""

    at_load: set[str] = field(default_factory=set)
    in_functions: set[str] = field(default_factory=set)

    @property
    def all(self) -> set[str]:
        return self.at_load | self.in_functions


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

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:  # only the else branch runs
                visit(child, in_function)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            (result.in_functions if in_function else result.at_load).update(_targets(node, module))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(modules()[module].read_text()), False)
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
    assert "torch" in imports_of("fsdprun.device").at_load
    assert "fsdprun.config" in load_graph()["fsdprun.engines.mesh"]  # the package runs first
    assert "fsdprun.config" not in load_graph()["fsdprun.config.load"]  # its own package


def test_config_never_imports_torch_nor_the_training_packages():
    bad = direct_violations(
        area("config"),
        ("torch", "fsdprun.data", "fsdprun.engines", "fsdprun.train", "fsdprun.launch"),
        # The sharding rules validate checks; the run directory's names (the metrics file's
        # default: plain path arithmetic).
        allowed=("fsdprun.engines.mesh", "fsdprun.launch.rundir"),
    )
    assert not bad, bad
    lazy = {t for m in area("config") for t in imports_of(m).in_functions}
    assert lazy <= {"fsdprun.engines.mesh", *CONFIG_LAZY_IMPORTS}, lazy


def test_loading_and_validating_a_recipe_loads_no_torch():
    """Everything loaded by importing config and calling `validate` (which imports the
    sharding rules): no torch, no data/train/launch."""
    starts = set(area("config"))
    for module in area("config"):
        for target in imports_of(module).in_functions - set(CONFIG_LAZY_IMPORTS):
            starts.update(_with_packages(target, module))
    seen, outside, via = loaded_by(starts)
    assert "torch" not in outside, path_to("torch", via)
    # launch.rundir only spells paths (no torch, no other fsdprun module): the trackers' folders.
    light = {"fsdprun.launch", "fsdprun.launch.rundir"}
    heavy = sorted(m for m in seen - light if m.split(".")[1] in ("data", "train", "launch"))
    assert not heavy, [path_to(m, via) for m in heavy]


def test_models_never_import_torch_distributed():
    bad = direct_violations(area("models"), ("torch.distributed",))
    assert not bad, bad


def test_report_never_imports_engines_or_train():
    bad = direct_violations(area("report"), ("fsdprun.engines", "fsdprun.train"))
    assert not bad, bad


def test_checkpoint_never_imports_train_nor_launch():
    # inspect and export read a folder offline; launch.rundir only spells its paths.
    bad = direct_violations(
        area("checkpoint"), ("fsdprun.train", "fsdprun.launch"), allowed=("fsdprun.launch.rundir",)
    )
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


def test_data_never_imports_engines_train_launch_or_models():
    bad = direct_violations(
        area("data"), ("fsdprun.engines", "fsdprun.train", "fsdprun.launch", "fsdprun.models")
    )
    assert not bad, bad


def test_tools_never_import_the_training_loop_nor_the_launcher():
    # plan prints the loss line the run header prints; status reads names and locks.
    allowed = ("fsdprun.train.loss", "fsdprun.launch.rundir", "fsdprun.launch.runlock")
    bad = direct_violations(area("tools"), ("fsdprun.train", "fsdprun.launch"), allowed=allowed)
    assert not bad, bad


def test_launch_never_imports_models_nor_engines():
    allowed = ("fsdprun.engines.float8",)  # the device check before workers start
    bad = direct_violations(area("launch"), ("fsdprun.models", "fsdprun.engines"), allowed=allowed)
    assert not bad, bad


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
