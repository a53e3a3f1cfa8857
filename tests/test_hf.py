"""HuggingFace models (`model.hf_path`) and `fsdprun export --format hf`.

A tiny random Llama saved by transformers' `save_pretrained` is trained at world 2 (fp32; the
worker's own training, in the session's gloo pool): its first loss must equal transformers' own
single-process forward on the same batch, and a few steps must lower it. Exports in HF format
must load with `AutoModelForCausalLM.from_pretrained` and hold exactly the trained weights
(HF-sourced run) or give fsdprun's logits (built-in Llama run), and name the run's end-of-text
token. The shipped folder (hf-finetune-demo) trains with the same losses under fsdp2
full/hybrid/none, fsdp1 and ddp and from a config.json saying bfloat16 (fp32 weights and AdamW
state), and its validation loss with attention dropout is transformers' eval-mode forward. Run
with `pytest tests/test_hf.py` (8 short training runs, 2 of them launched).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import Runs, consolidate, flatten, fsdprun_env, run_fsdprun, save_tiny_hf_llama
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdprun.checkpoint.export import data_eos_id, export_checkpoint
from fsdprun.config import load_recipe
from fsdprun.data import build_datasets, load_batch
from fsdprun.engines.hf_weights import HFWeights, chunk_rows
from fsdprun.errors import UserError
from fsdprun.models.hf import HFCausalLM
from fsdprun.models.llama import Transformer, build_model_args, hf_llama_name
from fsdprun.report.metrics import read_events

transformers = pytest.importorskip("transformers")

ENV = fsdprun_env(HF_HUB_OFFLINE="1")  # model loading must never reach the network
TOL = 1e-5
RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "data"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, GQA, vocab 256) plus stand-in tokenizer files."""
    path = save_tiny_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
    (path / "tokenizer.json").write_text('{"stand-in": true}')
    (path / "tokenizer_config.json").write_text("{}")
    return path


def _train(pool, *overrides: str) -> tuple[Path, list[dict]]:
    """The debug recipe, 4 steps, trained by 2 ranks of the session's gloo pool as launched
    ranks train it (tests/gloo_pool.py): these tests check the weights, not the launch."""
    run = pool.train("train.steps=4", "output.log_every=1", *overrides)
    return run.run_dir, run.events


def _export(ckpt: Path, out: Path, fmt: str) -> None:
    # In-process (the command itself is covered by test_inspect_export): a subprocess costs ~3 s.
    export_checkpoint(ckpt, out, fmt=fmt)


def _load_hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    ).eval()


@pytest.fixture(scope="module")
def hf_run(hf_dir, gloo_pool) -> tuple[Path, list[dict]]:
    """fsdprun fine-tunes the HF model at world 2, fp32 (the debug recipe), 4 steps."""
    return _train(gloo_pool, f"model.hf_path={hf_dir}")


def test_first_loss_matches_transformers_and_training_lowers_it(hf_dir, hf_run):
    _, events = hf_run
    start = next(e for e in events if e["event"] == "start")
    assert start["fsdp_units"] == ["hf.model.layers.0", "hf.model.layers.1", "<root>"]
    assert start["weights"] == f"pretrained, read from {hf_dir}"  # the header's weights line
    losses = [e["loss"] for e in events if e["event"] == "step"]
    # The 8 samples of global step 0, exactly as the workers load them.
    cfg = load_recipe("debug", [f"model.hf_path={hf_dir}"]).config
    data, _ = build_datasets(cfg.data, vocab_size=256, seq_len=cfg.train.seq_len, seed=0)
    batch = load_batch(data, range(cfg.train.global_batch_size), torch.device("cpu"))
    inputs, targets = batch.inputs, batch.targets
    with torch.no_grad():
        logits = _load_hf(hf_dir)(input_ids=inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(losses[0] - expected) < TOL, (losses[0], expected)
    assert losses[-1] < losses[0] - 0.05, losses


def test_hf_export_of_hf_run(hf_dir, hf_run, tmp_path):
    run_dir, _ = hf_run
    ckpt = run_dir / "checkpoints" / "step-00000004"
    out = tmp_path / "export"
    _export(ckpt, out, "hf")
    # The original config and tokenizer files, the trained weights (not the original ones).
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes()
    dcp_to_torch_save(ckpt, tmp_path / "full.pt")
    trained = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    loaded = _load_hf(out).state_dict()
    assert sorted(loaded) == sorted(k.removeprefix("hf.") for k in trained)
    for key, value in trained.items():
        torch.testing.assert_close(loaded[key.removeprefix("hf.")], value, rtol=0, atol=0)
    original = load_file(hf_dir / "model.safetensors")
    assert not torch.equal(original["model.norm.weight"], loaded["model.norm.weight"])


def test_random_init_of_hf_model(hf_dir, hf_run, gloo_pool):
    _, events = _train(gloo_pool, f"model.hf_path={hf_dir}", "model.init=random",
                       "train.steps=1", "schedule.warmup_steps=0")  # fmt: skip
    first = [e["loss"] for e in events if e["event"] == "step"][0]
    start = next(e for e in events if e["event"] == "start")
    assert start["weights"] == "random init (model.init=random, train.seed=0)"
    pretrained = [e["loss"] for e in hf_run[1] if e["event"] == "step"][0]
    assert torch.isfinite(torch.tensor(first)) and abs(first - pretrained) > 1e-4


def test_hf_export_of_builtin_llama_gives_the_same_logits(gloo_pool, tmp_path):
    # Byte-tokenized text: the export must name its end-of-text token (256), not Llama's 1 and 2.
    text = ["data.source=text", f"data.paths=[{RECIPES / 'tiny.txt'}]", "model.vocab_size=257"]
    run_dir, _ = _train(gloo_pool, "train.steps=2", *text)
    ckpt = run_dir / "checkpoints" / "step-00000002"
    _export(ckpt, tmp_path / "hf", "hf")
    _export(ckpt, tmp_path / "plain", "safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    model = Transformer(build_model_args(load_recipe("debug", text).config.model))
    model.load_state_dict(load_file(tmp_path / "plain" / "model.safetensors"))
    hf_model = _load_hf(tmp_path / "hf")
    assert (hf_model.config.eos_token_id, hf_model.config.bos_token_id) == (256, 256)
    assert hf_model.generation_config.eos_token_id == 256  # what generate() stops at
    assert sum(p.numel() for p in hf_model.parameters()) == sum(
        p.numel() for p in model.parameters()
    )
    tokens = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(tokens) - hf_model(input_ids=tokens).logits).abs().max().item()
    assert diff < TOL, diff


def test_hf_names_and_errors(tmp_path, monkeypatch):
    assert hf_llama_name("layers.3.feed_forward.w2.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_llama_name("output.weight") == "lm_head.weight"
    with pytest.raises(UserError, match="not a Llama tensor"):
        hf_llama_name("layers.0.extra.weight")
    with pytest.raises(UserError, match="has no config.json"):
        load_recipe("debug", [f"model.hf_path={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    cfg = load_recipe("debug", [f"model.hf_path={tmp_path}"]).config
    from fsdprun.models import build_model

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install 'fsdprun\[hf\]'"):
        build_model(cfg.model)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"needs transformers: pip install 'fsdprun\[hf\]'"):
        load_recipe("debug", [f"model.hf_path={tmp_path}"])


@pytest.mark.parametrize("rows,world_size", [(8, 2), (7, 2), (5, 4), (2, 3), (64, 3)])
def test_chunk_rows_follow_torch_chunk(rows, world_size):
    full = torch.arange(rows)
    chunks = list(torch.chunk(full, world_size)) + [full[:0]] * world_size
    for rank in range(world_size):
        start, stop = chunk_rows(rows, rank, world_size)
        assert torch.equal(full[start:stop], chunks[rank])


def test_shipped_hf_finetune_recipe_starts_pretrained_and_improves(tmp_path):
    proc = run_fsdprun("train", "hf-finetune-demo", "train.steps=10", "eval.every_steps=5",
                       "output.log_every=1", "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                       env=fsdprun_env(HF_HUB_OFFLINE="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = read_events(tmp_path / "run" / "metrics.jsonl")
    losses = [e["loss"] for e in events if e["event"] == "step"]
    evals = [e["val_loss"] for e in events if e["event"] == "eval"]
    # Pre-trained weights: far below a random model's ln(257) = 5.55 from the first step.
    assert losses[0] < 3.2
    assert evals[-1] < evals[0]


# --------------------------------------------------------------------------------------------
# The shipped HF folder (recipes/data/tiny-llama-hf) under every engine and sharding, from a
# config.json saying bfloat16, and with dropout. hf-finetune-demo trains it on the shipped text.

DEMO = ("train.steps=2", "output.log_every=1", "eval.every_steps=0")


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def demo_reference(gloo_pool) -> list[float]:
    """fsdp2, full sharding, 2 ranks; its first loss is transformers' own forward of the folder.
    (Runs of 2 ranks that check the weights, not the launch, train in the session's gloo
    process group: tests/gloo_pool.py.)"""
    losses = gloo_pool.train(*DEMO, recipe="hf-finetune-demo").losses
    cfg = load_recipe("hf-finetune-demo").config
    data, _ = build_datasets(cfg.data, vocab_size=257, seq_len=cfg.train.seq_len, seed=0)
    batch = load_batch(data, range(cfg.train.global_batch_size), torch.device("cpu"))
    inputs, targets = batch.inputs, batch.targets
    with torch.no_grad():
        logits = _load_hf(RECIPES / "tiny-llama-hf")(input_ids=inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(losses[0] - expected) < TOL, (losses[0], expected)
    return losses


def _hf_copy(dest: Path, *, drop: tuple[str, ...] = (), **config: object) -> Path:
    """A copy of the shipped HF folder, its config.json without the keys `drop`, with `config`."""
    shutil.copytree(RECIPES / "tiny-llama-hf", dest)
    data = json.loads((dest / "config.json").read_text())
    for key in drop:
        del data[key]
    (dest / "config.json").write_text(json.dumps({**data, **config}))
    return dest


# HF weights under fsdp1, ddp and fsdp2's `none` (and every other sharding) train against the
# plain run in tests/test_matrix.py; here the 2 x 2 mesh against transformers' own first loss.
@pytest.mark.parametrize(
    "overrides,nproc",
    [(("fsdp.sharding=hybrid", "fsdp.shard_group_size=2"), 4)],
    ids=["fsdp2-hybrid-2x2"],
)
def test_pretrained_weights_load_under_every_engine_and_sharding(
    demo_runs, demo_reference, overrides, nproc
):
    run = demo_runs.train(*DEMO, *overrides, "checkpoint.save_final=false", nproc=nproc,
                          recipe="hf-finetune-demo").check()  # fmt: skip
    assert len(run.losses) == len(demo_reference)
    for got, want in zip(run.losses, demo_reference, strict=True):
        assert abs(got - want) < TOL, (run.losses, demo_reference)


def test_bf16_folder_trains_fp32_master_weights(gloo_pool, demo_reference, tmp_path):
    # Most Llama releases say bfloat16: the weights and AdamW's state must still be fp32.
    folder = _hf_copy(tmp_path / "bf16", torch_dtype="bfloat16")
    run = gloo_pool.train(*DEMO, f"model.hf_path={folder}", recipe="hf-finetune-demo")
    for got, want in zip(run.losses, demo_reference, strict=True):
        assert abs(got - want) < TOL, (run.losses, demo_reference)
    state = flatten(consolidate(run.run_dir / "checkpoints" / "step-00000002", tmp_path / "a.pt"))
    params = {k: v.dtype for k, v in state.items() if k.startswith("model.")}
    moments = {k: v.dtype for k, v in state.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert len(params) == 21 and len(moments) == 2 * 21, sorted(state)
    assert set(params.values()) == set(moments.values()) == {torch.float32}, (params, moments)


@pytest.fixture(scope="module")
def dropout_run(gloo_pool, tmp_path_factory):
    """One step of the shipped folder with attention dropout and no special tokens in its
    config.json, evaluated and saved after the step (in the session's gloo process group)."""
    folder = _hf_copy(tmp_path_factory.mktemp("dropout") / "hf", attention_dropout=0.5,
                      drop=("bos_token_id", "eos_token_id"))  # fmt: skip
    run = gloo_pool.train("train.steps=1", "eval.every_steps=1", f"model.hf_path={folder}",
                          recipe="hf-finetune-demo")  # fmt: skip
    out = tmp_path_factory.mktemp("dropout_export") / "hf"
    _export(run.run_dir / "checkpoints" / "step-00000001", out, "hf")
    return run, _load_hf(out)


def test_eval_runs_in_eval_mode(dropout_run):
    run, exported = dropout_run
    (val_loss,) = [e["val_loss"] for e in run.events if e["event"] == "eval"]
    assert exported.config.attention_dropout == 0.5
    # transformers' eval-mode forward (no dropout) of the same weights on the same samples: the
    # first eval.batches global batches of the validation windows.
    cfg = load_recipe("hf-finetune-demo").config
    _, val = build_datasets(cfg.data, vocab_size=257, seq_len=cfg.train.seq_len, seed=0,
                            with_val=True)  # fmt: skip
    samples = range(cfg.eval.batches * cfg.train.global_batch_size)
    batch = load_batch(val, samples, torch.device("cpu"))
    inputs, targets = batch.inputs, batch.targets
    with torch.no_grad():
        logits = exported(input_ids=inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(val_loss - expected) < TOL, (val_loss, expected)


def test_hf_export_fills_in_the_runs_end_of_text(dropout_run):
    # The folder's config.json names no special tokens: the export names the byte tokenizer's
    # end-of-text (transformers would otherwise take Llama's 1 and 2, two byte values).
    _, exported = dropout_run
    assert (exported.config.eos_token_id, exported.config.bos_token_id) == (256, 256)
    assert exported.generation_config.eos_token_id == 256


def test_data_eos_id_of_each_source(tmp_path):
    assert data_eos_id({"source": "synthetic"}) is None
    assert data_eos_id({"source": "text", "tokenizer": "byte"}) == 256
    assert data_eos_id({"source": "tokens", "paths": [str(RECIPES / "tiny" / "train.bin")]}) == 256
    (tmp_path / "t.bin").write_bytes(b"\0" * 64)  # nanoGPT tokens without a data.json
    assert data_eos_id({"source": "tokens", "paths": [str(tmp_path / "t.bin")]}) is None
    with pytest.raises(UserError, match=r"the run's data.tokenizer .*does not exist"):
        data_eos_id({"source": "text", "tokenizer": str(tmp_path / "gone.json")})


def test_tied_hf_weights_stay_tied(tmp_path):
    # ddp loads the folder into the unwrapped model, whose to_empty unties shared parameters;
    # fsdp1 would materialize the tied copy apart, so it refuses in one line.
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = HFCausalLM.from_folder(tmp_path)
    weights = HFWeights(tmp_path, model)
    weights.load(model, device=torch.device("cpu"))
    embedding = load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"]
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    assert torch.equal(model.hf.lm_head.weight, embedding)
    with pytest.raises(UserError, match=r"ties lm_head.weight to .*fsdp.engine=fsdp2 or ddp"):
        weights.full("hf.lm_head.weight")


def test_token_ids_are_checked_against_the_hf_models_own_vocabulary(hf_dir, tmp_path):
    # Issue 20: the check before launch read model.vocab_size, which a model.hf_path model
    # ignores (its config.json says how many embeddings it has).
    from typer.testing import CliRunner

    from fsdprun.cli import app

    # A valid run was refused: the shipped folder has 257 embeddings whatever the key says.
    result = CliRunner().invoke(app, ["config", "sft-demo", "model.vocab_size=200"])
    assert result.exit_code == 0, result.output
    # An invalid one passed: byte-valued data (end-of-text 256) on hf_dir, cut to 256 embeddings.
    real = f"the model has 256 embeddings (vocab_size in {hf_dir / 'config.json'})"
    for args, what in [
        (["debug", "data.source=text", f"data.paths=[{RECIPES / 'tiny.txt'}]"],
         "data.tokenizer byte has 257 tokens but"),
        (["debug", "data.source=tokens", f"data.paths=[{RECIPES / 'tiny' / 'train.bin'}]"],
         "was tokenized with a 257-token vocabulary (tokenizer byte) but"),
        (["sft-demo"], "data: the examples hold token id 256 but"),
    ]:  # fmt: skip
        result = CliRunner().invoke(app, ["config", *args, f"model.hf_path={hf_dir}",
                                          "model.vocab_size=100000"])  # fmt: skip
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert f"{what} {real}" in line, line
        assert "model.vocab_size does not change a model.hf_path model" in line
    # `train` refuses it before launch: no worker, no run directory.
    proc = run_fsdprun("train", "sft-demo", f"model.hf_path={hf_dir}", "--run-dir",
                       str(tmp_path / "run"), cwd=tmp_path, env=ENV, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"data: the examples hold token id 256 but {real}" in line
    assert not (tmp_path / "run").exists()
