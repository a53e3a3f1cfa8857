"""Regenerate the recipe reference table in README.md from the schema (fsdprun.config).

.venv/bin/python scripts/update_readme.py
"""

from pathlib import Path

from fsdprun.config import recipe_reference

START, END = "<!-- recipe-reference:start -->\n", "<!-- recipe-reference:end -->"
readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
head, rest = text.split(START)
tail = rest[rest.index(END) :]
readme.write_text(head + START + recipe_reference() + tail)
