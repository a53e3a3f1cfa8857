"""The README and docs/ stay true (the recipe reference, the two commands, the links) and a
non-editable install ships the built-in recipes."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fsdprun.config import (
    RecipeConfig,
    builtin_recipes,
    config_to_dict,
    recipe_reference,
    schema_fields,
)

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RECIPES_DOC = ROOT / "docs" / "recipes.md"


def test_recipe_reference_is_current():
    block = RECIPES_DOC.read_text().split("<!-- recipe-reference:start -->\n")[1]
    block = block.split("<!-- recipe-reference")[0]
    assert block == recipe_reference(), "regenerate it: .venv/bin/python scripts/update_docs.py"
    assert "docs/recipes.md" in README


def test_recipe_reference_types_match_the_defaults():
    """Each key's type column admits its default (and says `or null` exactly when null is
    allowed), and every schema key has a row."""
    defaults = config_to_dict(RecipeConfig())
    rows = [line.split(" | ", 3) for line in recipe_reference().splitlines()[2:]]
    assert [row[0].strip("|` ") for row in rows] == list(schema_fields())
    kinds = {"int": int, "float": float, "bool": bool, "str": str, "enum": str}
    for key, type_name, _, _ in rows:
        key = key.strip("|` ")
        section, leaf = key.split(".")
        value = defaults[section][leaf]
        field = schema_fields()[key]
        assert type_name.endswith(" or null") == ("None" in str(field.type)), key
        base = type_name.removesuffix(" or null")
        if value is None:
            continue
        if base.startswith(("list[", "dict[")):
            assert isinstance(value, list if base.startswith("list[") else dict), key
        else:
            assert type(value) is kinds[base], (key, type_name, value)
        if base == "enum":
            assert f"`{value}`" in row_choices(recipe_reference(), key), key


def row_choices(reference: str, key: str) -> str:
    [row] = [line for line in reference.splitlines() if line.startswith(f"| `{key}` |")]
    return row.split("One of:")[1]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)  # no links and no headings in there


def markdown_links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", without_code_blocks(text))


def test_readme_and_docs_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists and, with
    `#anchor`, a heading of that file."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for link in markdown_links(page.read_text()):
            if link.startswith(("http://", "https://")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", without_code_blocks(target.read_text()), re.M)
                if anchor not in {github_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {link} (no such heading)")
    assert not broken, broken


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(bash scripts/setup.sh && [^\n]+)\n```", README)
    assert commands == [
        "bash scripts/setup.sh && .venv/bin/fsdprun train debug",
        "bash scripts/setup.sh && .venv/bin/python -m pytest -q",
    ]
    assert commands[1] in (ROOT / ".ci/run").read_text()


def test_every_builtin_recipe_is_in_the_readme():
    # The front page names each one; docs/recipes.md's table describes each.
    table = RECIPES_DOC.read_text()
    for name in builtin_recipes():
        assert f"`{name}`" in README and f"| `{name}` |" in table, name


def third_party_imports(package: Path) -> dict[str, set[str]]:
    """Top-level modules imported anywhere in `package` (also inside functions) that are neither
    the standard library nor the package itself, each with the files importing it."""
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != package.name:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()  # PEP 503


def test_every_third_party_import_is_a_declared_dependency():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    declared = {normalize(re.match(r"[A-Za-z0-9._-]+", req).group(0)) for req in reqs}
    # The import name's distribution where it is installed (yaml -> PyYAML), else the same name.
    dists = importlib.metadata.packages_distributions()
    imports = third_party_imports(ROOT / "fsdprun")
    assert {"torch", "numpy", "yaml", "safetensors"} <= imports.keys()  # the scan sees them
    undeclared = {
        module: sorted(files)
        for module, files in imports.items()
        if not any(normalize(d) in declared for d in dists.get(module, [module]))
    }
    assert not undeclared, f"imported but not in pyproject.toml (core or an extra): {undeclared}"


def test_wheel_ships_recipes_and_they_load_from_a_plain_install(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist")],
        check=True, capture_output=True, cwd=tmp_path, text=True,
    )  # fmt: skip
    # setuptools warns of data folders missing from `packages` (an error in a later release).
    assert "absent from the `packages`" not in build.stdout + build.stderr, build.stderr
    wheel = next((tmp_path / "dist").glob("fsdprun-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    # Every file of recipes/ (the recipes and their data), and nothing else, under fsdprun/recipes.
    tree = {
        f"fsdprun/recipes/{p.relative_to(ROOT / 'recipes').as_posix()}"
        for p in (ROOT / "recipes").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }  # fmt: skip
    assert {n for n in names if n.startswith("fsdprun/recipes/")} == tree
    for recipe in builtin_recipes():
        assert f"fsdprun/recipes/{recipe}.yaml" in names
    for data in ("tiny.txt", "tiny/train.bin", "tiny/val.bin", "tiny/data.json"):
        assert f"fsdprun/recipes/data/{data}" in names
    # Every module of the source tree ships (a package missing from `packages` is silently left
    # out of the wheel: fsdprun/tools/tune/ was, and `fsdprun tune` failed in a plain install).
    source = {
        p.relative_to(ROOT).as_posix() for p in (ROOT / "fsdprun").rglob("*.py")
        if "__pycache__" not in p.parts
    }  # fmt: skip
    assert source - set(names) == set()
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    code = (
        f"import fsdprun.config as c; assert c.__file__.startswith({str(site)!r}), c.__file__; "
        "print(sorted(c.builtin_recipes())); c.load_recipe('llama-8b'); "
        "import fsdprun.tools.tune; "
        # Their data paths resolve inside the installed package (and the files pass the checks).
        "p = c.load_recipe('tokens-demo').config.data.paths[0]; "
        f"assert p.startswith({str(site)!r}), p"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(sorted(builtin_recipes()))
