"""Unit tests for recipe loading: `extends:` layering, overrides, provenance, validation, dumps.

Every recipe is written to pytest's tmp_path; nothing here imports torch. Run with
`pytest tests/test_config.py`.
"""

from __future__ import annotations

import dataclasses
import textwrap
from importlib import resources
from pathlib import Path

import pytest

from fsdprun.config import (
    CLI_SOURCE,
    DEFAULT_SOURCE,
    CompileMode,
    Dtype,
    RecipeConfig,
    WrapPolicy,
    builtin_recipes,
    dump_config,
    explain,
    load_recipe,
    parse_overrides,
    parse_size,
    schema_fields,
    validate,
)
from fsdprun.errors import UserError

DEFAULTS = RecipeConfig()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def one_line_error(recipe: str | Path, overrides: list[str] | None = None, **kwargs) -> str:
    """The message of the UserError that loading raises; it must be a single line."""
    with pytest.raises(UserError) as info:
        load_recipe(str(recipe), overrides, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def source(path: Path) -> str:
    """How provenance names a recipe file: its resolved path."""
    return str(path.resolve())


# --------------------------------------------------------------------------------------------
# Layering


def test_extends_single_parent(tmp_path):
    base = write(
        tmp_path / "base.yaml",
        """
        optim:
          lr: 1.0e-3
        train:
          steps: 10
          seed: 3
        """,
    )
    child = write(
        tmp_path / "child.yaml",
        """
        extends: base.yaml
        train:
          steps: 20
        """,
    )
    resolved = load_recipe(str(child))
    cfg = resolved.config
    assert cfg.optim.lr == 1e-3
    assert cfg.train.seed == 3
    assert cfg.train.steps == 20  # the child wins over its parent
    assert cfg.train.seq_len == DEFAULTS.train.seq_len
    assert [layer.source for layer in resolved.layers] == [source(base), source(child)]
    assert resolved.provenance["optim.lr"] == source(base)
    assert resolved.provenance["train.steps"] == source(child)
    assert resolved.provenance["train.seq_len"] == DEFAULT_SOURCE
    assert resolved.name == "child"


def test_extends_list_merges_parents_in_order(tmp_path):
    first = write(
        tmp_path / "first.yaml",
        """
        optim:
          lr: 0.1
          weight_decay: 0.2
        train:
          steps: 5
        """,
    )
    second = write(
        tmp_path / "second.yaml",
        """
        optim:
          lr: 0.2
        schedule:
          warmup_steps: 3
        """,
    )
    child = write(
        tmp_path / "child.yaml",
        """
        extends: [first.yaml, second.yaml]
        train:
          seed: 7
        """,
    )
    resolved = load_recipe(str(child))
    cfg = resolved.config
    assert cfg.optim.lr == 0.2  # the later parent wins
    assert cfg.optim.weight_decay == 0.2
    assert cfg.train.steps == 5
    assert cfg.schedule.warmup_steps == 3
    assert cfg.train.seed == 7
    assert [layer.source for layer in resolved.layers] == [
        source(first),
        source(second),
        source(child),
    ]
    assert resolved.provenance["optim.lr"] == source(second)
    assert resolved.provenance["optim.weight_decay"] == source(first)
    assert resolved.provenance["train.seed"] == source(child)


def test_extends_paths_are_relative_to_the_recipe_file(tmp_path, monkeypatch):
    grand = write(tmp_path / "recipes" / "common" / "grand.yaml", "train:\n  steps: 11\n")
    parent = write(
        tmp_path / "recipes" / "common" / "parent.yaml",
        "extends: grand.yaml\noptim:\n  lr: 0.05\n",
    )
    child = write(
        tmp_path / "recipes" / "exp" / "child.yaml",
        "extends: ../common/parent.yaml\ntrain:\n  seed: 1\n",
    )
    # Load from an unrelated directory, by a relative path: parents must still be found
    # next to the file that names them, not in the working directory.
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    resolved = load_recipe("../recipes/exp/child.yaml")
    cfg = resolved.config
    assert (cfg.train.steps, cfg.optim.lr, cfg.train.seed) == (11, 0.05, 1)
    assert resolved.provenance["train.steps"] == source(grand)
    assert resolved.provenance["optim.lr"] == source(parent)
    assert resolved.provenance["train.seed"] == source(child)


def test_extends_builtin_recipe(tmp_path):
    child = write(tmp_path / "mine.yaml", "extends: debug\ntrain:\n  steps: 7\n")
    resolved = load_recipe(str(child))
    debug = load_recipe("debug").config
    cfg = resolved.config
    assert cfg.train.steps == 7
    assert debug.train.steps != 7
    assert cfg.model == debug.model
    assert cfg.precision.param_dtype is Dtype.fp32
    assert resolved.provenance["model.dim"] == "builtin:debug"
    assert resolved.provenance["train.steps"] == source(child)
    assert resolved.layers[0].source == "builtin:debug"


def test_overrides_are_applied_last(tmp_path):
    base = write(tmp_path / "base.yaml", "optim:\n  lr: 0.1\ntrain:\n  steps: 4\n")
    child = write(tmp_path / "child.yaml", "extends: base.yaml\noptim:\n  lr: 0.2\n")
    resolved = load_recipe(
        str(child), ["optim.lr=0.5", "optim.betas=[0.8, 0.99]", "precision.param_dtype=fp16"]
    )
    cfg = resolved.config
    assert cfg.optim.lr == 0.5
    assert cfg.optim.betas == [0.8, 0.99]
    assert cfg.precision.param_dtype is Dtype.fp16
    assert cfg.train.steps == 4
    assert resolved.layers[-1].source == CLI_SOURCE
    assert resolved.provenance["optim.lr"] == CLI_SOURCE
    assert resolved.provenance["optim.betas"] == CLI_SOURCE
    assert resolved.provenance["train.steps"] == source(base)


def test_override_values_are_typed():
    values, drops = parse_overrides(
        ["optim.lr=0.01", "train.steps=3", "optim.betas=[0.8, 0.9]", "~train.seed"]
    )
    assert values == {"optim.lr": 0.01, "train.steps": 3, "optim.betas": [0.8, 0.9]}
    assert drops == ["train.seed"]


def test_drop_returns_a_key_to_its_schema_default(tmp_path):
    base = write(tmp_path / "base.yaml", "train:\n  steps: 20\n  seed: 5\n")
    child = write(tmp_path / "child.yaml", "extends: base.yaml\ntrain:\n  steps: 30\n")
    resolved = load_recipe(str(child), ["~train.steps"])
    assert resolved.config.train.steps == DEFAULTS.train.steps  # set by both files, dropped
    assert resolved.provenance["train.steps"] == DEFAULT_SOURCE
    assert resolved.config.train.seed == 5  # untouched keys keep their layer
    assert resolved.provenance["train.seed"] == source(base)


def test_drop_a_key_set_by_a_builtin():
    resolved = load_recipe("debug", ["~launch.nproc_per_node", "~optim.lr"])
    assert resolved.config.launch.nproc_per_node == DEFAULTS.launch.nproc_per_node
    assert resolved.config.optim.lr == DEFAULTS.optim.lr
    assert resolved.provenance["optim.lr"] == DEFAULT_SOURCE
    assert resolved.provenance["model.dim"] == "builtin:debug"


def test_builtin_name_works_beside_a_directory_of_that_name(tmp_path, monkeypatch):
    (tmp_path / "debug").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_recipe("debug").provenance["model.dim"] == "builtin:debug"


# --------------------------------------------------------------------------------------------
# Provenance


def parse_explain(text: str) -> dict[str, tuple[str, str]]:
    """`explain()` output → {dotted key: (value text, source)}."""
    out: dict[str, tuple[str, str]] = {}
    section = None
    for line in text.splitlines():
        if not line.startswith(" "):
            assert line.endswith(":"), line
            section = line[:-1]
            continue
        entry, src = line.strip().rsplit(" # ", 1)
        key, value = entry.split(":", 1)
        dotted = f"{section}.{key}"
        assert dotted not in out, dotted
        out[dotted] = (value.strip(), src)
    return out


def test_explain_names_the_layer_of_every_key(tmp_path):
    child = write(
        tmp_path / "child.yaml",
        """
        extends: debug
        train:
          steps: 12
        """,
    )
    resolved = load_recipe(str(child), ["optim.lr=0.01"])
    shown = parse_explain(explain(resolved))
    assert list(shown) == list(schema_fields())
    assert shown["model.family"] == ("llama", "default")
    assert shown["model.dim"] == ("64", "builtin:debug")
    assert shown["train.steps"] == ("12", source(child))
    assert shown["optim.lr"] == ("0.01", "command line")
    assert shown["optim.betas"] == ("[0.9, 0.95]", "default")
    assert {src for _, src in shown.values()} == {
        "default",
        "builtin:debug",
        source(child),
        "command line",
    }


# --------------------------------------------------------------------------------------------
# Errors: one line, naming the key or path and what would be valid


def test_unknown_key_suggests_the_closest(tmp_path):
    recipe = write(tmp_path / "r.yaml", "optim:\n  lrr: 0.1\n")
    message = one_line_error(recipe)
    assert str(recipe.resolve()) in message
    assert "unknown key 'optim.lrr'" in message
    assert "did you mean 'optim.lr'" in message


def test_unknown_section_suggests_the_closest(tmp_path):
    recipe = write(tmp_path / "r.yaml", "modle:\n  dim: 64\n")
    message = one_line_error(recipe)
    assert "unknown section 'modle'" in message
    assert "did you mean 'model'" in message


def test_wrong_type_names_key_value_and_type(tmp_path):
    recipe = write(tmp_path / "r.yaml", "train:\n  steps: abc\n")
    message = one_line_error(recipe)
    assert str(recipe.resolve()) in message
    assert "train.steps" in message
    assert "'abc'" in message
    assert "integer" in message.lower()


def test_bad_enum_lists_the_allowed_values(tmp_path):
    recipe = write(tmp_path / "r.yaml", "precision:\n  param_dtype: bf32\n")
    message = one_line_error(recipe)
    assert "precision.param_dtype" in message
    assert "bf32" in message
    for allowed in ("bf16", "fp16", "fp32"):
        assert allowed in message


def test_global_batch_must_divide_by_micro_batch_times_world():
    message = one_line_error("debug", ["launch.nproc_per_node=3"])
    assert "train.global_batch_size (8)" in message
    assert "train.micro_batch_size (2)" in message
    assert "data-parallel ranks (3)" in message
    # The real world size of a worker counts, not launch.*.
    assert "data-parallel ranks (3)" in one_line_error("debug", world_size=3)
    assert load_recipe("debug", world_size=4).config.train.global_batch_size == 8


def test_validate_returns_one_message_per_problem():
    assert validate(RecipeConfig()) == []
    assert validate(load_recipe("debug").config) == []
    cfg = load_recipe("debug").config
    cfg.train.seq_len = cfg.model.max_seq_len * 2
    cfg.launch.nproc_per_node = 3
    errors = validate(cfg)
    assert len(errors) == 2
    assert errors[0].startswith("train.seq_len (128) exceeds model.max_seq_len (64)")
    assert errors[1].startswith("train.global_batch_size (8) must be divisible")


def test_seq_len_longer_than_max_seq_len(tmp_path):
    recipe = write(tmp_path / "r.yaml", "train:\n  seq_len: 512\n")
    message = one_line_error(recipe)
    assert "train.seq_len (512)" in message
    assert "model.max_seq_len (256)" in message
    assert "raise model.max_seq_len or shorten train.seq_len" in message


@pytest.mark.parametrize(
    ("override", "key", "shown"),
    [
        ("optim.lr=0", "optim.lr", "0.0"),
        ("optim.lr=-1.0e-3", "optim.lr", "-0.001"),
        ("train.steps=0", "train.steps", "0"),
        ("train.steps=-5", "train.steps", "-5"),
    ],
)
def test_non_positive_values_are_rejected(override, key, shown):
    message = one_line_error("debug", [override])
    assert message == f"{key} must be > 0 (got {shown})"


def test_several_problems_are_reported_together():
    message = one_line_error("debug", ["optim.lr=0", "train.steps=0"])
    assert "optim.lr must be > 0" in message
    assert "train.steps must be > 0" in message


def test_nan_learning_rate_is_rejected():
    message = one_line_error("debug", ["optim.lr=.nan"])
    assert "optim.lr" in message


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    recipe = write(tmp_path / "r.yaml", "train:\n  steps: 3\n  seq_len: [64\n")
    message = one_line_error(recipe)
    assert message.startswith(f"{recipe.resolve()}: line ")
    assert "YAML syntax error" in message
    line = int(message.split(": line ", 1)[1].split(",", 1)[0])
    assert line >= 3


def test_yaml_syntax_error_in_a_parent_names_the_parent(tmp_path):
    parent = write(tmp_path / "parent.yaml", "optim:\n  lr: 0.1\n  betas: [0.9\n")
    child = write(tmp_path / "child.yaml", "extends: parent.yaml\n")
    message = one_line_error(child)
    assert message.startswith(f"{parent.resolve()}: line ")


def test_extends_cycle(tmp_path):
    a = write(tmp_path / "a.yaml", "extends: b.yaml\ntrain:\n  steps: 1\n")
    b = write(tmp_path / "b.yaml", "extends: a.yaml\ntrain:\n  steps: 2\n")
    message = one_line_error(a)
    assert "'extends' cycle" in message
    assert f"{a.resolve()} -> {b.resolve()} -> {a.resolve()}" in message


def test_extends_itself(tmp_path):
    a = write(tmp_path / "a.yaml", "extends: a.yaml\n")
    assert "'extends' cycle" in one_line_error(a)


def test_missing_extends_file(tmp_path):
    child = write(tmp_path / "child.yaml", "extends: nope.yaml\n")
    message = one_line_error(child)
    assert message.startswith(f"{child.resolve()}: extends ")
    assert "'nope.yaml'" in message
    assert "neither a file nor a built-in recipe" in message
    assert "debug" in message  # lists the built-ins


def test_missing_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = one_line_error("nonexistent.yaml")
    assert "'nonexistent.yaml' is neither a file nor a built-in recipe" in message
    assert "built-ins: " in message
    assert "debug" in message


@pytest.mark.parametrize(
    ("typo", "suggested"),
    [("debugg", "debug"), ("lama-8b", "llama-8b"), ("sft_demo", "sft-demo"),
     ("text-demo.yml", "text-demo")],
)  # fmt: skip
def test_recipe_name_typo_is_suggested(tmp_path, monkeypatch, typo, suggested):
    monkeypatch.chdir(tmp_path)
    message = one_line_error(typo)
    assert f"'{typo}' is neither a file nor a built-in recipe; did you mean '{suggested}'?" in (
        message
    )


def test_recipe_far_from_every_name_gets_no_suggestion(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "did you mean" not in one_line_error("zzzzzz")


def test_extends_must_be_names(tmp_path):
    recipe = write(tmp_path / "r.yaml", "extends: [1, 2]\n")
    assert "'extends' must be a recipe name or path" in one_line_error(recipe)


def test_recipe_must_be_a_mapping(tmp_path):
    recipe = write(tmp_path / "r.yaml", "- model\n- train\n")
    message = one_line_error(recipe)
    assert str(recipe.resolve()) in message
    assert "must be a mapping of sections" in message
    assert "not a list" in message


def test_section_must_be_a_mapping(tmp_path):
    recipe = write(tmp_path / "r.yaml", "train: 5\n")
    assert "'train' must be a mapping of keys" in one_line_error(recipe)


@pytest.mark.parametrize("text", ["", "# only a comment\n"], ids=["empty", "comment-only"])
def test_empty_recipe(tmp_path, text):
    recipe = write(tmp_path / "r.yaml", text)
    message = one_line_error(recipe)
    assert message == f"{recipe.resolve()}: the recipe is empty; it needs at least one section"


def test_override_without_equals():
    with pytest.raises(UserError) as info:
        parse_overrides(["optim.lr"])
    message = str(info.value)
    assert "\n" not in message
    assert "override 'optim.lr' has no '='" in message
    assert "KEY=VALUE" in message


@pytest.mark.parametrize("override", ["optim.lrr=0.1", "~optim.lrr"])
def test_override_of_an_unknown_key(override):
    message = one_line_error("debug", [override])
    assert f"override '{override}'" in message
    assert "unknown key 'optim.lrr'" in message
    assert "did you mean 'optim.lr'" in message


def test_override_with_wrong_type_names_the_command_line():
    message = one_line_error("debug", ["train.steps=abc"])
    assert message.startswith("command line: train.steps: ")
    assert "'abc'" in message


@pytest.mark.parametrize(
    ("key", "value", "want"),
    [("fsdp.wrap_classes", "{a: b}", "a list"), ("output.wandb", "[a, b]", "a mapping")],
)
def test_a_mapping_for_a_list_key_or_a_list_for_a_mapping_key(tmp_path, key, value, want):
    # OmegaConf's merge raised a bare TypeError for these (a traceback, not one line).
    message = one_line_error("debug", [f"{key}={value}"])
    assert message.startswith(f"command line: {key}: ") and want in message, message
    section, leaf = key.split(".")
    recipe = write(tmp_path / "r.yaml", f"{section}:\n  {leaf}: {value}\n")
    assert one_line_error(recipe).startswith(f"{source(recipe)}: {key}: ")


# --------------------------------------------------------------------------------------------
# Interpolations and YAML tags: a recipe is data


def test_resolver_in_a_file_is_rejected(tmp_path):
    recipe = write(tmp_path / "r.yaml", "output:\n  run_dir: ${oc.env:HOME}/runs\n")
    message = one_line_error(recipe)
    assert str(recipe.resolve()) in message
    assert "output.run_dir" in message
    assert "'${oc.env:HOME}' is not allowed" in message
    assert "${train.seq_len}" in message  # says what is allowed


def test_resolver_in_an_override_is_rejected():
    message = one_line_error("debug", ["output.run_dir=${oc.env:HOME}"])
    assert message.startswith("command line: output.run_dir: '${oc.env:HOME}' is not allowed")


def test_resolver_inside_a_list_is_rejected(tmp_path):
    recipe = write(
        tmp_path / "r.yaml", "fsdp:\n  wrap: classes\n  wrap_classes: ['${oc.env:HOME}']\n"
    )
    assert "'${oc.env:HOME}' is not allowed" in one_line_error(recipe)


def test_reference_to_another_key_resolves(tmp_path):
    recipe = write(
        tmp_path / "r.yaml",
        """
        model:
          max_seq_len: ${train.seq_len}
        train:
          seq_len: 32
        """,
    )
    cfg = load_recipe(str(recipe)).config
    assert cfg.model.max_seq_len == 32
    assert isinstance(cfg.model.max_seq_len, int)
    cfg = load_recipe(str(recipe), ["train.seq_len=48"]).config
    assert cfg.model.max_seq_len == 48  # references resolve after every layer
    cfg = load_recipe("debug", ["model.max_seq_len=${train.seq_len}", "train.seq_len=16"]).config
    assert cfg.model.max_seq_len == 16


def test_python_tags_are_not_constructed(tmp_path):
    marker = tmp_path / "pwned"
    recipe = write(
        tmp_path / "r.yaml",
        f"train:\n  steps: !!python/object/apply:os.system ['touch {marker}']\n",
    )
    message = one_line_error(recipe)
    assert message.startswith(f"{recipe.resolve()}: line 2")
    assert "python/object/apply:os.system" in message
    assert not marker.exists()
    # An override value is parsed with the same safe loader.
    with pytest.raises(UserError):
        load_recipe("debug", [f"train.steps=!!python/object/apply:os.system ['touch {marker}']"])
    assert not marker.exists()


# --------------------------------------------------------------------------------------------
# Dumping and built-in recipes


def reload(tmp_path: Path, cfg: RecipeConfig) -> RecipeConfig:
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(cfg))
    return load_recipe(str(path)).config


def test_dump_config_reloads_to_an_equal_config(tmp_path):
    cfg = load_recipe(
        "debug",
        [
            "compile.enabled=true",
            "compile.mode=max-autotune",
            "precision.param_dtype=bf16",
            "fsdp.wrap=classes",
            "fsdp.wrap_classes=[TransformerBlock]",
            "model.n_kv_heads=null",
            "optim.betas=[0.8, 0.99]",
            "output.run_dir=/tmp/somewhere",
            "output.peak_tflops=312.5",
        ],
    ).config
    assert cfg.compile.mode is CompileMode.max_autotune
    assert cfg.fsdp.wrap is WrapPolicy.classes
    again = reload(tmp_path, cfg)
    assert again == cfg
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def test_dump_config_of_the_defaults_reloads(tmp_path):
    assert reload(tmp_path, RecipeConfig()) == RecipeConfig()


def test_builtin_recipes_include_debug_with_its_description():
    recipes = builtin_recipes()
    assert "debug" in recipes
    assert recipes["debug"].startswith("Tiny Llama on synthetic data")
    assert all(recipes.values()), recipes  # every built-in says what it is for


BUILTINS = sorted(builtin_recipes())


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_recipe_loads_and_round_trips(tmp_path, name):
    resolved = load_recipe(name)
    assert resolved.name == name
    assert resolved.layers[-1].source == f"builtin:{name}"
    assert validate(resolved.config) == []
    assert reload(tmp_path, resolved.config) == resolved.config


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_recipe_starts_with_its_command(name):
    text = (resources.files("fsdprun.recipes") / f"{name}.yaml").read_text()
    first = text.splitlines()[0]
    assert first.startswith("# fsdprun train"), first
    assert first.split()[3] == name, first


def test_parse_size_reads_the_units_of_both_options():
    # --max-shard-size: a bare number is bytes; --device-memory: a bare number is GB.
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000 and parse_size(" 1.5 mb ") == 1_500_000
    assert parse_size("80", bare_unit="GB") == 80 * 10**9
    assert parse_size("24GiB", bare_unit="GB") == 24 * 2**30
    for bad in ("lots", "0GB", "-1GB", "5XB", ""):
        with pytest.raises(UserError, match=f"^--device-memory {bad!r}: expected a size"):
            parse_size(bad, option="--device-memory", expected="a size such as 80GB")


# --------------------------------------------------------------------------------------------
# `auto`: null's spelling where null lets fsdprun decide


def test_auto_is_accepted_wherever_null_means_auto(tmp_path, monkeypatch):
    """`precision.float8_all_gather=auto` was refused ("not a valid bool") while
    `parallel.cp_impl=auto` was taken (issue 51). Every key whose null lets fsdprun decide takes
    `auto`, on the command line of `fsdprun train` and in a recipe file; the typed config holds
    null; `fsdprun config` (and --explain) prints `auto`, which loads back; a key whose null
    means something else (model.n_kv_heads: n_heads) keeps refusing it."""
    from typer.testing import CliRunner

    import fsdprun.launch.elastic
    from fsdprun.cli import app

    recipe = write(tmp_path / "r.yaml", "extends: debug\nfsdp:\n  reshard_after_forward: auto\n")
    launched = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fsdprun.launch.elastic, "elastic_launch",
                        lambda config, entry: lambda *a: launched.append(a) or {})  # fmt: skip
    CliRunner().invoke(app, ["train", str(recipe), "precision.float8_all_gather=auto",
                             "--run-dir", "run"])  # fmt: skip
    assert launched, "fsdprun train refused precision.float8_all_gather=auto"
    written = (tmp_path / "run" / "recipe.yaml").read_text()  # what the ranks read
    assert "float8_all_gather: auto" in written and "reshard_after_forward: auto" in written
    cfg = load_recipe(str(tmp_path / "run" / "recipe.yaml")).config
    assert cfg.precision.float8_all_gather is None and cfg.fsdp.reshard_after_forward is None
    for args in ([], ["--explain"]):
        result = CliRunner().invoke(app, ["config", str(recipe), *args])
        assert result.exit_code == 0, result.output
        assert "float8_all_gather: auto" in result.stdout, result.stdout
        assert "reshard_after_forward: auto" in result.stdout, result.stdout
    shown = CliRunner().invoke(app, ["config", str(recipe), "fsdp.reshard_after_forward=false"])
    assert "reshard_after_forward: false" in shown.stdout
    assert "or auto (null)" in one_line_error("debug", ["precision.float8_all_gather=maybe"])
    assert "model.n_kv_heads" in one_line_error("debug", ["model.n_kv_heads=auto"])
    from fsdprun.config.schema import auto_keys

    assert set(auto_keys()) == {"precision.float8_all_gather", "fsdp.reshard_after_forward"}
