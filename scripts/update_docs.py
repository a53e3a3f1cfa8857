"""Regenerate the generated parts of the docs: the recipe reference table in docs/recipes.md
from the schema, and the composition table in docs/parallelism.md from the rules that refuse a
recipe (fsdprun.config.composition); print the share of the table's cells that are exact.

.venv/bin/python scripts/update_docs.py
"""

from pathlib import Path

from fsdprun.config import recipe_reference
from fsdprun.config.composition import (
    LAYOUTS,
    composition_table,
    exact_share,
    family_cells,
    feature_cells,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def replace_block(doc: Path, name: str, text: str) -> None:
    """Put `text` between the page's `<!-- NAME:start -->` and `<!-- NAME:end -->` lines."""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    page = doc.read_text()
    head, rest = page.split(start)
    doc.write_text(head + start + text + rest[rest.index(end) :])


replace_block(DOCS / "recipes.md", "recipe-reference", recipe_reference())
cells = feature_cells() + family_cells()
replace_block(DOCS / "parallelism.md", "composition", composition_table(cells))
exact, total = exact_share(cells)
print(f"docs/parallelism.md: {exact} of {total} cells exact ({100 * exact / total:.0f}%)")
for layout in LAYOUTS:
    exact, total = exact_share(cells, (layout,))
    print(f"  {layout}: {exact} of {total}")
