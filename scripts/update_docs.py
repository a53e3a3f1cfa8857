"""Regenerate the recipe reference table in docs/recipes.md from the schema (fsdprun.config).

.venv/bin/python scripts/update_docs.py
"""

from pathlib import Path

from fsdprun.config import recipe_reference

START, END = "<!-- recipe-reference:start -->\n", "<!-- recipe-reference:end -->"
doc = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
text = doc.read_text()
head, rest = text.split(START)
tail = rest[rest.index(END) :]
doc.write_text(head + START + recipe_reference() + tail)
