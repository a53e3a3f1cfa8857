"""The composition table (fsdprun/config/composition.py, docs/parallelism.md): the page holds the
table the rules give; every exact cell names a test that exists and trains it against one rank;
no refusal left says "not verified"; the family cells' tiny shape is what transformers makes of
it; and the covering set, which trains the exact cells no other test trains, each run against
one rank.

The covering set's runs train in the session's 4-rank and 1-rank gloo groups (tests/gloo_pool.py,
shared with tests/test_tp.py and tests/test_cp.py), as `fsdprun train ... --nproc-per-node 4`
trains: each switches on several features at once, so that one run covers a cell of each.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from fsdprun.config import composition
from fsdprun.config.composition import TESTS, composition_table, family_cells, feature_cells

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "parallelism.md"
START, END = "<!-- composition:start -->\n", "<!-- composition:end -->"


@pytest.fixture(scope="module")
def cells() -> list[composition.Cell]:
    return feature_cells() + family_cells()


def test_the_page_holds_the_table_the_rules_give(cells):
    block = PAGE.read_text().split(START)[1].split(END)[0]
    assert block == composition_table(cells), (
        "regenerate it: .venv/bin/python scripts/update_docs.py"
    )


def test_every_exact_cell_names_a_test_that_exists(cells):
    """Each exact cell's test node id names a test function of a test file, and its
    parametrization where it gives one; every mapped cell is exact (a refused cell names no
    test: its mapping is stale)."""
    exact = {(c.layout, c.row) for c in cells if c.exact}
    assert not exact - TESTS.keys(), f"exact cells naming no test: {sorted(exact - TESTS.keys())}"
    assert not TESTS.keys() - exact, f"refused cells naming a test: {sorted(TESTS.keys() - exact)}"
    for node in sorted(set(TESTS.values())):
        path, _, name = node.partition("::")
        function, _, param = name.partition("[")
        module = _test_module(ROOT / path)
        assert callable(getattr(module, function, None)), f"{node}: no test {function} in {path}"
        if param:
            ids = _parametrize_ids(getattr(module, function))
            assert param.rstrip("]") in ids, f"{node}: {function} has the ids {ids}"


def _test_module(path: Path):
    """The test file as pytest imports it (tests/ is on sys.path: conftest's `rootdir`)."""
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _parametrize_ids(function) -> list[str]:
    """The ids pytest gives `function`'s parametrizations (explicit ids, pytest.param ids, or
    its own from plain values), joined in the order it joins stacked marks."""
    ids = [""]
    for mark in getattr(function, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], list(mark.args[1])
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        given = mark.kwargs.get("ids")
        mine = []
        for i, value in enumerate(values):
            if given is not None:
                mine.append(str(given[i]))
            elif getattr(value, "id", None) is not None:
                mine.append(value.id)
            else:
                value = getattr(value, "values", value)
                parts = value if len(names) > 1 else (value,)
                mine.append("-".join(
                    str(v) if isinstance(v, str | int | float | bool | type(None)) else f"{n}{i}"
                    for n, v in zip(names, parts, strict=True)
                ))  # fmt: skip
        ids = [f"{a}-{b}" if a else b for a in ids for b in mine]
    return ids


def test_no_refusal_left_says_what_is_not_verified(cells):
    """A refusal names the library limit or the missing math, never what is "not verified"."""
    for why in (why for c in cells for why in c.refusals):
        assert not re.search(r"verified", why), why


def test_the_tiny_shape_gives_the_answers_of_transformers_whole_config(cells):
    """The family cells read a few keys of config.json (`tiny_config_json`); transformers'
    whole config of the same tiny shape (every default written out, as save_pretrained does)
    gives each cell the same answer, so the stated shape is the tested folders'."""
    from hf_families import tiny_config

    whole = {family: tiny_config(family).to_dict() for family in composition.TINY_FAMILIES}
    assert [(c.layout, c.row, c.refusals) for c in family_cells(whole)] == [
        (c.layout, c.row, c.refusals) for c in cells if c.row in composition.TINY_FAMILIES
    ]


def test_a_family_without_a_tp_plan_is_refused_in_trains_words(monkeypatch, tmp_path):
    """A family whose TP plan is a sentence (why it has none) is refused by the table in the
    words `fsdprun train`'s model check says (engines.tp.tp_plan_problem, which names the built
    model's class too)."""
    import json

    from fsdprun.config import load_recipe
    from fsdprun.engines.preflight import check_model
    from fsdprun.errors import UserError
    from fsdprun.families import HF_FAMILIES, Family

    monkeypatch.setitem(HF_FAMILIES, "llama", Family(tp_plan="a reason of its own"))
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(composition.tiny_config_json("llama")))
    overrides = ["parallel.tp=2", f"model.hf_path={folder}"]
    (table,) = composition.refusals(overrides)
    cfg = load_recipe("debug", [*overrides, "launch.nproc_per_node=4"]).config
    with pytest.raises(UserError) as train:
        check_model(cfg, weights=False)
    assert re.sub(r" \(\w+ForCausalLM\)", "", str(train.value)) == table, (table, train.value)


def test_update_docs_prints_the_share_of_exact_cells(capsys, tmp_path):
    """scripts/update_docs.py writes the generated blocks (here into a copy of the docs) and
    prints the share of exact cells: issue 52's measure, over the columns and per column."""
    import runpy
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "scripts").mkdir()
    script = shutil.copy(ROOT / "scripts" / "update_docs.py", tmp_path / "scripts")
    (tmp_path / "docs" / "parallelism.md").write_text(f"# page\n{START}stale\n{END}\n")
    runpy.run_path(script, run_name="__main__")
    cells = feature_cells() + family_cells()
    exact, total = composition.exact_share(cells)
    out = capsys.readouterr().out
    assert f"{exact} of {total} cells exact ({100 * exact / total:.0f}%)" in out, out
    for layout in composition.LAYOUTS:
        assert "{}: {} of {}".format(layout, *composition.exact_share(cells, (layout,))) in out
    page = (tmp_path / "docs" / "parallelism.md").read_text()
    assert page == f"# page\n{START}{composition_table(cells)}{END}\n"


# --- the covering set: the exact cells no other test trains ------------------------------------
# One step of 8 sequences of 64 tokens, 3 steps, optim.eps=1e-4 (the gradient norms and losses
# then follow the parameters to 1e-5, as tests/test_cp.py's); nothing saved. Each run switches on
# the features it covers at once; its reference is one rank with the overrides that change the
# model (`model.*`, `lora.*`), which parallel layouts, sharding, offload, checkpointing and the
# loss's chunking must not change.
BASE = ("model.n_kv_heads=4", "train.steps=3", "train.micro_batch_size=1", "output.log_every=1",
        "schedule.warmup_steps=1", "optim.eps=1e-4", "checkpoint.save_final=false")  # fmt: skip
SELECTIVE, OFFLOAD = "activation_checkpointing.mode=selective", "fsdp.cpu_offload=true"
COVERING: dict[str, tuple[str, ...]] = {
    "dp-selective-chunked-hybrid-offload": (SELECTIVE, "train.loss=chunked",
                                            "fsdp.sharding=hybrid", "fsdp.shard_group_size=2",
                                            OFFLOAD),
    "dp-lora-full": ("lora.rank=8", "activation_checkpointing.mode=full"),
    "tp2-selective-hybrid-offload": ("parallel.tp=2", SELECTIVE, "fsdp.sharding=hybrid",
                                     "fsdp.shard_group_size=1", OFFLOAD),
    "cp2-selective-offload": ("parallel.cp=2", SELECTIVE, OFFLOAD),
    # cp x tp (4 kv heads: the all-to-all): 1 data-parallel rank, 2 micro-steps of 4
    # sequences; FSDP2 offloads the TP-split (2-D) parameters it shards over cp; hybrid sharding
    # with one replica of one shard group (at 4 ranks cp x tp leaves 1 data-parallel rank).
    "cp2-tp2-selective-hybrid-offload": ("parallel.cp=2", "parallel.tp=2",
                                         "train.micro_batch_size=4", SELECTIVE,
                                         "fsdp.sharding=hybrid", OFFLOAD),
    **{f"tp2-{family}": ("parallel.tp=2", f"model.hf_path={{{family}}}")
       for family in ("qwen2", "qwen3", "mistral", "gemma2")},
    # The families' 2 kv heads are 1 per TP rank, which cp 2 cannot split: the ring, on its
    # zig-zag chunks, under tensor parallel (windows, soft-capping, q/k norms, fused projections).
    **{f"cp2-tp2-{family}": ("parallel.cp=2", "parallel.tp=2", "train.micro_batch_size=4",
                             f"model.hf_path={{{family}}}")
       for family in ("qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "phi3")},
    # The built-in Llama's tied embedding and output: split alike (vocab rows) and tied again.
    "tp2-tied": ("parallel.tp=2", "model.tie_embeddings=true"),
    # LoRA's adapters split as their Linears under TP, each cp rank's tokens through them.
    "cp2-tp2-lora": ("parallel.cp=2", "parallel.tp=2", "train.micro_batch_size=4",
                     "lora.rank=8"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(COVERING))
def test_covering_set_trains_as_one_rank(name, gloo_pool_4, gloo_pool_1, hf_family_dirs,
                                         monkeypatch):  # fmt: skip
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    over = [o.format(**hf_family_dirs) for o in COVERING[name]]
    run = gloo_pool_4.train(*BASE, *over)
    one = gloo_pool_1.train(*BASE, *(o for o in over if o.startswith(("model.", "lora."))))
    got, want = run.steps, one.steps
    assert [e["step"] for e in got] == [e["step"] for e in want] == [1, 2, 3]
    for mine, theirs in zip(got, want, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5), (name, got, want)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), (name, got)
        assert mine["trained_tokens"] == theirs["trained_tokens"] == 8 * 64
    knobs = {k["key"]: k["applied"] for k in run.start["engine_knobs"]}
    assert knobs["fsdp.cpu_offload"] == ("CPUOffloadPolicy" if OFFLOAD in over else "off")
    if "fsdp.sharding=hybrid" in over:  # a replica dim beside the shard groups
        replicas = 1 if "parallel.tp=2" in over and "parallel.cp=2" in over else 2
        assert run.start["mesh"][0] in (["replicate", replicas], ["dp_replicate", replicas])
