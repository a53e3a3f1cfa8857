"""The commands that only read files answer at once: they never import torch.

`import torch` alone takes ~1.6 s on a small machine, so `--help`, `--version`, `recipes`,
`config` (with `--explain`, and with data files to check) and `status` must not load it, on
success and on a user error; `train`, `resume` and `compare` refuse a key typo or a missing file
before their launcher loads it. `recipes` reads its cards without merging a recipe, and text
options reach a command without typer's pydantic adapters. What a user reads first of a run is
its header, not the libraries' notices. Each command runs in a fresh interpreter. Run with
`pytest tests/test_cli_startup.py`; `scripts/bench_startup.py` times them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import FSDPRUN, fsdprun_env

from fsdprun.config import accelerator_device_nodes
from fsdprun.config.composition import TINY_FAMILIES, tiny_config_json

# Runs every command in turn in one fresh interpreter through the Typer app (as the console
# script does) and records, after each, its exit code and whether torch was loaded by then.
PROBE = """
import json, sys
from typer.testing import CliRunner
from fsdprun.cli import app
out = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(app, args)
    out.append([args, result.exit_code, "torch" in sys.modules, result.output[-300:],
                "numpy" in sys.modules])
print(json.dumps(out))
"""


def run_probe(commands: list[list[str]], cwd) -> list:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(commands)],
        cwd=cwd, env=fsdprun_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_read_only_commands_never_import_torch(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = [
        {"event": "start", "step": 0, "steps": 20, "world_size": 2},
        {"event": "step", "step": 1, "loss": 5.5},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    # (command, exit code)
    commands = [
        (["--help"], 0),
        (["train", "--help"], 0),
        (["--version"], 0),
        (["recipes"], 0),
        (["config", "debug"], 0),
        (["config", "debug", "--explain", "--nproc-per-node", "1"], 0),
        # Data recipes: the preflight reads token file headers and sizes the text.
        (["config", "tokens-demo"], 0),
        (["config", "text-demo", "--explain"], 0),
        (["status", str(run_dir)], 0),
        (["status", str(run_dir), "--json"], 0),
        # User errors answer at once too.
        (["config", "debug", "optim.lrr=1"], 2),
        (["config", "tokens-demo", "data.paths=[missing.bin]"], 2),
        (["status", str(tmp_path / "nothing")], 2),
    ]
    if not accelerator_device_nodes():
        # launch.device=auto resolved for this check (FSDP1 offload needs an accelerator):
        # with no accelerator device node it is CPU without asking torch.
        commands.append(
            (["config", "llama-1b", "launch.device=auto", "fsdp.engine=fsdp1",
              "fsdp.cpu_offload=true"], 2)
        )  # fmt: skip
    results = run_probe([args for args, _ in commands], tmp_path)
    assert [code for _, code, *_ in results] == [code for _, code in commands], results
    loaded = [(args, tail) for args, _, torch_loaded, tail, _ in results if torch_loaded]
    # The first command listed is the one that imported it.
    assert not loaded, loaded[0]
    # Nor numpy (~0.1 s more): the data checks read headers and sizes only.
    with_numpy = [args for args, _, _, _, numpy_loaded in results if numpy_loaded]
    assert not with_numpy, with_numpy[0]


def test_launching_commands_refuse_mistakes_before_torch_loads(tmp_path):
    """train, resume and compare refuse a key typo or a missing file as `config` does: one line,
    exit 2, before the launcher (and torch) loads."""
    from fsdprun.config import load_recipe

    run_dir = tmp_path / "run"  # a run directory's files without a checkpoint yet
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(load_recipe("debug").to_yaml())
    # (command, a word of the error line)
    commands = [
        (["train", "debug", "optim.lrr=1"], "optim.lrr"),
        (["train", "tokens-demo", "data.paths=[missing.bin]"], "missing.bin"),
        (["train", "debug", "--nproc-per-node", "3"], "global_batch_size"),
        (["resume", str(tmp_path / "nothing")], "not an fsdprun run directory"),
        (["resume", str(run_dir), "optim.lrr=1"], "optim.lrr"),
        (["resume", str(run_dir)], "no checkpoints to resume from"),
        (["compare", "debug", "optim.lrr=1"], "optim.lrr"),
        (["compare", "tokens-demo", "data.paths=[missing.bin]"], "missing.bin"),
    ]
    if not accelerator_device_nodes():
        # A recipe sized for GPUs on a machine without one: refused before launch, naming the
        # override that forces CPU (was: a silent CPU run of the 886M model, or no output).
        gpu = load_recipe("llama-8b").config
        gpu_run = tmp_path / "gpu-run"
        (gpu_run / "checkpoints" / "step-00000004").mkdir(parents=True)
        (gpu_run / "recipe.yaml").write_text(load_recipe("llama-8b").to_yaml())
        assert gpu.launch.nproc_per_node == 8
        commands += [
            (["train", "llama-1b"], "launch.device=cpu forces a CPU run"),
            (["train", "llama-8b", "--nproc-per-node", "8"], "launch.device=cpu forces"),
            (["train", "llama-70b", "--node-rank", "1", "--rdzv-endpoint", "node0:29500"],
             "launch.device=cpu forces"),
            (["compare", "llama-1b"], "launch.device=cpu forces a CPU run"),
            (["resume", str(gpu_run)], "launch.device=cpu forces a CPU run"),
        ]  # fmt: skip
    results = run_probe([args for args, _ in commands], tmp_path)
    for (args, word), (_, code, torch_loaded, tail, _) in zip(commands, results, strict=True):
        assert code == 2, (args, tail)
        assert word in tail and tail.strip().startswith("error:"), (args, tail)
        assert not torch_loaded, (args, tail)


def test_inspect_checkpoint_reads_dcp_metadata_without_torch_distributed(fsdprun_runs, tmp_path):
    """DCP's `.metadata` is read by fsdprun's own restricted unpickler: inspecting a checkpoint
    loads neither torch.distributed.checkpoint nor the saving and loading side (torch itself
    still comes with the model family's description of the model row)."""
    run = fsdprun_runs.train("train.steps=6", "output.log_every=1", "train.micro_batch_size=1")
    ckpt = run.check().run_dir / "checkpoints" / "step-00000006"
    probe = (
        "import json, sys\nfrom typer.testing import CliRunner\nfrom fsdprun.cli import app\n"
        "out = [CliRunner().invoke(app, args).exit_code for args in json.loads(sys.argv[1])]\n"
        "heavy = ('torch.distributed.checkpoint', 'fsdprun.checkpoint.save',\n"
        "         'fsdprun.checkpoint.restore')\n"
        "print(json.dumps([out, [m for m in heavy if m in sys.modules]]))\n"
    )
    commands = [
        ["inspect-checkpoint", str(ckpt)],
        ["inspect-checkpoint", str(ckpt), "--json", "--tensors", "model.*"],
        ["inspect-checkpoint", str(run.run_dir)],
        ["inspect-checkpoint", str(ckpt), "--diff", str(ckpt)],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(commands)],
        cwd=tmp_path, env=fsdprun_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    codes, loaded = json.loads(proc.stdout)
    assert codes == [0, 0, 0, 0]
    assert loaded == []


def test_torch_loads_without_a_garbage_collection(tmp_path):
    """`train` and `plan` import torch, the launcher and torch._dynamo with the cyclic collector
    paused, then freeze them: no collection walks the half-loaded heap. On the old code these two
    commands ran 654 collections while torch modules loaded, 6 of them full (about 0.5 CPU s of a
    fresh `fsdprun train`); a lazy import after the freeze may still see a young one."""
    probe = (
        "import gc, json, sys\nfrom typer.testing import CliRunner\nfrom fsdprun.cli import app\n"
        "seen = []\n"
        "def during_imports(phase, info):\n"
        "    # A collection started while a torch module is being imported.\n"
        "    frame = sys._getframe(1)\n"
        "    files = []\n"
        "    while frame is not None:\n"
        "        files.append(frame.f_code.co_filename)\n"
        "        frame = frame.f_back\n"
        "    if phase == 'start' and any('importlib._bootstrap' in f for f in files) and any(\n"
        "            '/torch/' in f for f in files):\n"
        "        seen.append(info['generation'])\n"
        "gc.callbacks.append(during_imports)\n"
        "codes = [CliRunner().invoke(app, args).exit_code for args in json.loads(sys.argv[1])]\n"
        "print(json.dumps([codes, seen, 'torch._dynamo' in sys.modules, gc.get_freeze_count()]))\n"
    )
    commands = [["plan", "debug"], ["train", "debug", "--run-dir", str(tmp_path / "run")]]
    proc = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(commands)], cwd=tmp_path,
        # Refused in the launcher after its imports and pre-launch checks, before any worker.
        env=fsdprun_env(FSDPRUN_START_METHOD="bogus"), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    codes, seen, dynamo, frozen = json.loads(proc.stdout)
    assert codes == [0, 2], proc.stdout
    assert len(seen) < 5 and max(seen, default=0) == 0, proc.stdout
    assert dynamo and frozen > 100_000, proc.stdout
    assert not (tmp_path / "run").exists()


def test_cli_works_with_a_typer_that_lacks_the_option_type_column(tmp_path):
    """Older typers (the H200 image's) have no `TyperOption.display_type_rich`, which the CLI
    patches for flags' help: it must then leave it alone, not fail every command at import."""
    probe = (
        "import typer.core\n"
        "for cls in typer.core.TyperOption.__mro__:\n"
        "    if 'display_type_rich' in vars(cls):\n"
        "        delattr(cls, 'display_type_rich')\n"
        "from typer.testing import CliRunner\n"
        "from fsdprun.cli import app\n"
        "for args in (['config', 'debug'], ['recipes']):\n"
        "    result = CliRunner().invoke(app, args)\n"
        "    assert result.exit_code == 0, (args, result.output)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=tmp_path, env=fsdprun_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# `fsdprun recipes` with the merge of recipe layers refused, then `config` (which merges) with
# text options: what each printed, and what was loaded by then.
RECIPES_PROBE = """
import json, sys
import fsdprun.config.load as load
from typer.testing import CliRunner
from fsdprun.cli import app

merged, real_merge = [], load._merge

def refuse(layers):
    merged.append(layers[-1].source)
    raise AssertionError("a recipe was merged")

load._merge = refuse
recipes = CliRunner().invoke(app, ["recipes"])
loaded = {m: m in sys.modules for m in ("torch", "pydantic")}
load._merge = real_merge
configs = [CliRunner().invoke(app, args).exit_code for args in (
    ["config", "debug", "optim.lr=1e-3", "~train.seed", "--nproc-per-node", "2"],
    ["config", "debug", "--explain"],
)]
print(json.dumps({"code": recipes.exit_code, "output": recipes.output, "merged": merged,
                  "loaded": loaded, "configs": configs, "pydantic": "pydantic" in sys.modules}))
"""


def test_recipes_reads_its_cards_without_merging_a_recipe(tmp_path):
    """`fsdprun recipes` reads the few keys each card shows from the recipes' layers as plain
    YAML: merging every built-in recipe through OmegaConf was half its time (issue 57) and grew
    with each recipe. Its cards are the merged recipes' all the same. Neither it nor `config`
    loads torch, nor typer's pydantic adapters for text options (60 ms)."""
    from fsdprun.config import builtin_recipes, load_recipe
    from fsdprun.config.model_facts import model_facts
    from fsdprun.config.reference import runs_on
    from fsdprun.config.sizes import config_num_params, model_num_params
    from fsdprun.report.console import fmt_count

    proc = subprocess.run(
        [sys.executable, "-c", RECIPES_PROBE], cwd=tmp_path, env=fsdprun_env(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["code"] == 0 and not got["merged"], got
    assert got["loaded"] == {"torch": False, "pydantic": False}, got["loaded"]
    assert got["configs"] == [0, 0] and not got["pydantic"], got
    # Each line as the merged recipe has it: name, where it runs, parameters, description.
    lines = got["output"].splitlines()
    assert len(lines) == len(builtin_recipes())
    for line, (name, description) in zip(lines, builtin_recipes().items(), strict=True):
        cfg = load_recipe(name, [], check=False).config
        count = model_num_params(cfg.model) or config_num_params(model_facts(cfg.model))
        expected = [name, runs_on(cfg.launch), fmt_count(count) if count else "?", description]
        assert re.split(r"\s{2,}", line.strip(), maxsplit=3) == expected, line


def test_a_card_whose_keys_need_the_merge_is_merged(tmp_path):
    """A card key that is not a plain value (a ${...} reference, text the schema converts to a
    number or a flag) is read from the merged recipe, so the card still shows its figures."""
    from fsdprun.config import load_recipe
    from fsdprun.config.reference import recipe_card, runs_on
    from fsdprun.config.sizes import model_num_params

    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "extends: debug\ntrain:\n  micro_batch_size: 4\n"
        "launch:\n  nproc_per_node: ${train.micro_batch_size}\n  nnodes: '3'\n"
        "model:\n  tie_embeddings: 'on'\n"
    )
    card = recipe_card(str(recipe), "mine")
    cfg = load_recipe(str(recipe), [], check=False).config
    assert card.runs_on == runs_on(cfg.launch) == "3 nodes x 4 CPU ranks"
    assert card.num_params == model_num_params(cfg.model)
    assert cfg.model.tie_embeddings and card.num_params < recipe_card("debug", "").num_params


# Each HF family's tiny config (the composition table's), and the variants that change the count:
# a mixture of experts with dense layers among its sparse ones, tied and untied embeddings.
CONFIG_COUNTS = {
    **{family: {} for family in TINY_FAMILIES},
    "qwen3_moe-dense-layers": {"mlp_only_layers": [0], "decoder_sparse_step": 1,
                               "num_hidden_layers": 3},
    "qwen3_moe-every-second": {"decoder_sparse_step": 2, "num_hidden_layers": 4},
    "llama-tied": {"tie_word_embeddings": True},
    "gemma2-untied": {"tie_word_embeddings": False},
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONFIG_COUNTS))
def test_a_folder_without_weights_counts_as_transformers_builds_it(case, tmp_path):
    """A recipe's HF folder with no weights (random init, as qwen3-30b-a3b's) shows on its card
    the parameters transformers builds from its config.json, counted without torch; a config
    this count does not cover (biased attention) says so (None, shown as '?')."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from fsdprun.config.model_facts import model_facts
    from fsdprun.config.schema import ModelConfig
    from fsdprun.config.sizes import config_num_params

    family = case.split("-")[0]
    config = {**tiny_config_json(family), **CONFIG_COUNTS[case]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path)
        )
    built = sum(p.numel() for p in model.parameters())  # a tied weight once
    assert config_num_params(model_facts(ModelConfig(hf_path=str(tmp_path)))) == built
    config["attention_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert config_num_params(model_facts(ModelConfig(hf_path=str(tmp_path)))) is None


def test_text_options_reach_commands_as_typers_own_adapters_give_them():
    """The CLI hands a `str` or `list[str]` parameter's text on without building typer's
    pydantic adapter (fsdprun.cli._text_as_typed): what each command of the app receives must
    be what typer's own adapter gives, value and type, for every such parameter."""
    import pytest

    coercion = pytest.importorskip("typer._coercion")
    if not hasattr(coercion, "build_runtime_param"):
        pytest.skip("this typer has no adapters to compare with")
    import typer.main

    from fsdprun.cli import app

    group = typer.main.get_command(app)
    texts = ["debug", "optim.lr=3e-4", "", " spaced ", "ünï/cödé", "~train.seed", "-"]
    checked = 0
    for command in [group, *group.commands.values()]:
        for param in command.params:
            descriptor = getattr(param, "type_descriptor", None)
            if descriptor is None or descriptor.annotation not in (str, list[str]):
                continue
            values = [tuple(texts)] if descriptor.annotation == list[str] else texts
            ours, typers = param.get_runtime_param(), coercion.build_runtime_param(descriptor)
            for value in [None, *values]:
                got = ours.coerce(value, param=param, ctx=None)
                want = typers.coerce(value, param=param, ctx=None)
                assert (got, type(got)) == (want, type(want)), (command.name, param.name, value)
                checked += 1
    assert checked > 50


def test_a_run_of_an_hf_folder_opens_with_its_header(tmp_path):
    """The first line a user reads of `fsdprun train` on a HuggingFace folder is fsdprun's
    header. The launcher's plan loads transformers, whose quantizers import torchao wherever it
    is installed; torchao then wrote that its CUDA kernel libraries failed to load (on a CPU
    torch) and torch 2.13 that registering Enums as pytree constants is deprecated, four lines
    before the header (issue 57). Only fsdprun's own `warning:` and `note:` lines may come
    first, and no known notice anywhere on the console. A fresh process, as a user starts it:
    the suite's zygote imported transformers (and printed the notices) long before."""
    from fsdprun.report.notices import KNOWN_NOTICES

    proc = subprocess.run(
        [FSDPRUN, "train", "hf-finetune-demo", "train.steps=1", "eval.every_steps=0",
         "checkpoint.save_final=false", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=fsdprun_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("fsdprun hf-finetune-demo: "))
    first = [line for line in lines[:header] if not line.startswith(("warning: ", "note: "))]
    assert not first, lines[: header + 1]
    for notice in KNOWN_NOTICES:
        assert not [line for line in lines if re.search(notice.pattern, line)], notice.name
