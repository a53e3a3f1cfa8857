"""The model families' names: which module defines each family's `ModelSpec`, and why a recipe's
`model.family` / `model.hf_path` choose none.

Both `config` (which refuses an unknown family before anything loads) and `models` (which
imports the family's module and reads its `SPEC`) need these names, and `models` reads config's
sections, so the names live here, at the package's ground floor, rather than in either: config
then never imports `models`, and the two packages import each other in no circle. Adding a
family is its module under `fsdprun.models` plus one line in `FAMILIES`.

Never imports torch nor an fsdprun module (`fsdprun config` loads it).
"""

from __future__ import annotations

# Family name -> the module defining its SPEC (imported when a recipe asks for the family).
FAMILIES = {
    "llama": "fsdprun.models.llama",
    "hf": "fsdprun.models.hf",
}
HF_FAMILY = "hf"  # chosen by model.hf_path


def family_problem(family: str, hf_path: str | None) -> str | None:
    """Why `model.family` / `model.hf_path` choose no family (one line), or None."""
    if family not in FAMILIES:
        return f"model.family: '{family}' is not known; the families are {', '.join(FAMILIES)}"
    if family == HF_FAMILY and hf_path is None:
        return "model.family: 'hf' needs model.hf_path (a HuggingFace model folder or Hub id)"
    return None
