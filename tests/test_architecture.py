"""docs/architecture.md against the code: the rooms it draws, the floors, the rules and the files.

The page's table (Floor | Room | Owns | Never imports) is read as data: every room it names
exists and every room of the package is drawn; a room loads (at module level) only rooms on
lower floors, the ground floor's only one another, but for the package edges
tests/test_imports.py allows; its "Never imports" column is exactly that test's rule table
(`NEVER_IMPORTS`, the exceptions after "but", the ground floor's "any room above"). Every file
or folder the page names in backticks exists. Run with `pytest tests/test_architecture.py`.
"""

from __future__ import annotations

import re

from test_imports import (
    GROUND_FLOOR,
    NEVER_IMPORTS,
    NEVER_IMPORTS_ALLOWED,
    PACKAGE,
    modules,
    package_graph,
    room,
)

ROOT = PACKAGE.parent
PAGE = ROOT / "docs" / "architecture.md"
# What "five minutes" allows: about 250 words a minute for prose with code names in it.
MAX_WORDS = 1300


def rows() -> list[dict[str, str]]:
    """The floors table: one dict per room (Floor, Room, Owns, Never imports)."""
    lines = [line for line in PAGE.read_text().splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == ["Floor", "Room", "Owns", "Never imports"], header
    return [
        dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        for line in lines[1:]
    ]


def names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def drawn_room(row: dict[str, str]) -> str:
    (name,) = names(row["Room"])
    return "fsdprun" if name == "fsdprun" else f"fsdprun.{name}"


def test_every_room_drawn_exists_and_every_room_is_drawn():
    drawn = [drawn_room(r) for r in rows()]
    assert len(drawn) == len(set(drawn)), drawn
    assert set(drawn) == {room(m) for m in modules()}


def test_a_room_loads_only_rooms_on_lower_floors():
    floor = {drawn_room(r): int(r["Floor"]) for r in rows()}
    wrong = [
        f"{a} (floor {floor[a]}) loads {b} (floor {floor[b]})"
        for a, targets in package_graph().items()
        for b in targets
        if floor[b] > floor[a] or (floor[b] == floor[a] and floor[a] > 0)
    ]
    assert not wrong, wrong


def test_the_rules_drawn_are_the_rules_tested():
    never, allowed, ground = {}, set(), set()
    for row in rows():
        name = drawn_room(row).removeprefix("fsdprun.")
        cell = row["Never imports"]
        forbidden, _, but = cell.partition(" but ")
        if "any room above" in forbidden:
            ground.add(f"fsdprun.{name}")
        if names(forbidden):
            never[name] = set(names(forbidden))
        allowed |= {(name, module) for module in names(but)}
    assert never == {k: set(v) for k, v in NEVER_IMPORTS.items()}
    assert allowed == set(NEVER_IMPORTS_ALLOWED)
    assert ground == set(GROUND_FLOOR)


def test_every_file_and_folder_named_exists():
    # `models/llama.py`, `config/`, `rundir.py`: under fsdprun/ or the repository.
    paths = [n for n in names(PAGE.read_text()) if re.fullmatch(r"[\w./<>-]+(\.py|\.md|/)", n)]
    assert len(paths) > 20, paths  # the reader found the page's file names
    missing = [
        p for p in paths if "<" not in p and not (PACKAGE / p).exists() and not (ROOT / p).exists()
    ]
    assert not missing, missing


def test_the_page_reads_in_five_minutes():
    assert len(PAGE.read_text().split()) <= MAX_WORDS
