"""Token and text data: prepare-data, the sample order, checks before launch, validation loss,
and exact continuation on token files (real runs: CPU, gloo, the shipped demo recipes)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Run, fsdprun_env, run_fsdprun
from typer.testing import CliRunner

from fsdprun.checkpoint import list_checkpoints
from fsdprun.cli import app
from fsdprun.config import load_recipe
from fsdprun.data import BatchLayout, build_datasets, save_tokenized
from fsdprun.data import text as text_data
from fsdprun.data.files import token_dtype_for
from fsdprun.data.preflight import check_data
from fsdprun.data.text import build_tokenizer, iter_documents, tokenize_to_array
from fsdprun.data.windows import ShuffledWindows, TokenWindows
from fsdprun.errors import UserError
from fsdprun.launch.elastic import launch_training

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
EOS = 256


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.output


def read_tokens(path: Path, dtype: str) -> list[int]:
    return np.fromfile(path, dtype=dtype).tolist()


# --------------------------------------------------------------------------------------------
# prepare-data


def test_prepare_data_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_bytes("héllo\r\n".encode())
    (tmp_path / "b.jsonl").write_text('{"body": "ab", "id": 1}\n\n{"body": "c"}\n')
    out = tmp_path / "out"
    result = invoke("prepare-data", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
                    "--out", str(out), "--text-field", "body")  # fmt: skip
    assert result.exit_code == 0, result.output
    want = [*"héllo\r\n".encode(), EOS, 97, 98, EOS, 99, EOS]
    assert read_tokens(out / "train.bin", "uint16") == want
    desc = json.loads((out / "data.json").read_text())
    assert desc["dtype"] == "uint16" and desc["vocab_size"] == 257 and desc["tokenizer"] == "byte"
    assert desc["num_tokens"] == len(want) and desc["files"] == {"train.bin": {"num_tokens": 14}}
    assert "wrote 14 uint16 tokens" in result.stdout

    # A validation fraction: the tail of the same stream.
    (tmp_path / "long.txt").write_text("x" * 99)
    result = invoke("prepare-data", str(tmp_path / "long.txt"), "--out", str(tmp_path / "v"),
                    "--val-fraction", "0.2")  # fmt: skip
    assert result.exit_code == 0, result.output
    train, val = read_tokens(tmp_path / "v/train.bin", "uint16"), read_tokens(
        tmp_path / "v/val.bin", "uint16")  # fmt: skip
    assert len(train) == 80 and val == [120] * 19 + [EOS]
    assert json.loads((tmp_path / "v/data.json").read_text())["files"]["val.bin"] == {
        "num_tokens": 20}  # fmt: skip

    # Mistakes: one line, exit 2.
    one_line_error(invoke("prepare-data", str(tmp_path / "b.jsonl"), "--out",
                          str(tmp_path / "w")), "line 1: no text field 'text'")  # fmt: skip
    one_line_error(invoke("prepare-data", str(tmp_path / "a.txt"), "--out", str(out)),
                   "is not an empty folder")  # fmt: skip
    one_line_error(invoke("prepare-data", str(tmp_path / "nope.txt"), "--out",
                          str(tmp_path / "w")), "does not exist")  # fmt: skip


def test_shipped_token_files_are_what_prepare_data_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(RECIPES)
    result = invoke("prepare-data", "data/tiny.txt", "--out", str(tmp_path / "tiny"),
                    "--val-fraction", "0.1")  # fmt: skip
    assert result.exit_code == 0, result.output
    for name in ("train.bin", "val.bin", "data.json"):
        assert (tmp_path / "tiny" / name).read_bytes() == (
            RECIPES / "data/tiny" / name
        ).read_bytes()


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype_for(257) == token_dtype_for(65536) == "uint16"
    assert token_dtype_for(65537) == "uint32"


def test_huggingface_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 70_000, "world": 5}
    vocab.update({f"w{i}": i for i in range(6, 70_000)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world\nw7 nonsense")
    out = tmp_path / "out"
    result = invoke("prepare-data", str(tmp_path / "a.txt"), "--out", str(out), "--tokenizer",
                    str(tmp_path / "tokenizer.json"))  # fmt: skip
    assert result.exit_code == 0, result.output
    desc = json.loads((out / "data.json").read_text())
    assert desc["dtype"] == "uint32" and desc["vocab_size"] == 70_001 and desc["eos_id"] == 0
    assert read_tokens(out / "train.bin", "uint32") == [70_000, 5, 7, 1, 0]
    # Training on them with a smaller model vocabulary is refused before launch.
    one_line_error(
        invoke("config", "tokens-demo", f"data.paths=[{out}/train.bin]", "~data.val_paths",
               "eval.every_steps=0"),
        "was tokenized with a 70001-token vocabulary",
    )  # fmt: skip


def _eos_tokenizer(folder: Path, eos: str = "[EOS]") -> Path:
    """A word-level tokenizer.json whose end-of-text is spelled `eos` (id 1), in `folder`."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, eos: 1, "a": 2, "b": 3, "c": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.mark.parametrize(
    ("beside", "flag", "want"),
    [
        # The folder's own files name it: tokenizer_config.json by spelling, config.json or
        # generation_config.json by id (Llama 3 lists several: the first).
        ({"tokenizer_config.json": {"eos_token": {"content": "[EOS]"}}}, [], [2, 3, 1, 4, 1]),
        ({"config.json": {"eos_token_id": 1}}, [], [2, 3, 1, 4, 1]),
        ({"generation_config.json": {"eos_token_id": [1, 4]}}, [], [2, 3, 1, 4, 1]),
        # Named on the command line, or no separator on purpose.
        ({}, ["--eos-token", "[EOS]"], [2, 3, 1, 4, 1]),
        ({"config.json": {"eos_token_id": 1}}, ["--eos-token", "none"], [2, 3, 4]),
    ],
    ids=["tokenizer_config", "config", "generation_config", "flag", "none"],
)
def test_end_of_text_with_an_unexpected_spelling(tmp_path, beside, flag, want):
    # Issue 20: a tokenizer whose end-of-text is `[EOS]` (none of the five known spellings)
    # got no separator at all between documents, silently.
    tokenizer = _eos_tokenizer(tmp_path / "tok")
    for name, content in beside.items():
        (tmp_path / "tok" / name).write_text(json.dumps(content))
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n{"text": "c"}\n')
    result = invoke("prepare-data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out"),
                    "--tokenizer", str(tokenizer), *flag)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert read_tokens(tmp_path / "out" / "train.bin", "uint16") == want
    assert json.loads((tmp_path / "out" / "data.json").read_text())["eos_id"] == (
        1 if 1 in want else None
    )


def test_no_end_of_text_found_and_none_named_is_refused_in_one_line(tmp_path):
    tokenizer = _eos_tokenizer(tmp_path / "tok")
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n' * 40)  # > one window, with or without
    out = tmp_path / "out"
    message = "no end-of-text token found"
    for fix in ("data.eos_token (prepare-data --eos-token)", "set it to none for no separator"):
        one_line_error(
            invoke("prepare-data", str(tmp_path / "d.jsonl"), "--out", str(out),
                   "--tokenizer", str(tokenizer)),
            fix,
        )  # fmt: skip
    assert not out.exists()
    # Before launch, in a recipe: `config` refuses it, and a named token must be in the vocabulary.
    text = ["config", "text-demo", f"data.paths=[{tmp_path / 'd.jsonl'}]", "~data.val_fraction",
            "eval.every_steps=0", f"data.tokenizer={tokenizer}"]  # fmt: skip
    one_line_error(invoke(*text), message)
    one_line_error(invoke(*text, "data.eos_token=<eos>"), "data.eos_token '<eos>' (--eos-token)")
    assert invoke(*text, "data.eos_token=[EOS]").exit_code == 0
    assert invoke(*text, "data.eos_token=none").exit_code == 0
    # Instruct responses end with it too: the same refusal for fine-tuning examples.
    (tmp_path / "i.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    one_line_error(
        invoke("prepare-data", str(tmp_path / "i.jsonl"), "--out", str(out), "--source",
               "instruct", "--tokenizer", str(tokenizer), "--template", "{prompt}"),
        message,
    )  # fmt: skip
    # The byte tokenizer: id 256 as before, or no separator on purpose.
    assert build_tokenizer("byte").eos_id == EOS and build_tokenizer("byte", "none").eos_id is None
    with pytest.raises(UserError, match="the byte tokenizer's end-of-text is id 256"):
        build_tokenizer("byte", "[EOS]")


def test_text_data_reads_a_tokenizer_folder_as_instruct_data_does(tmp_path):
    # data.tokenizer names a HuggingFace folder (a model's, or a Hub id's cached snapshot) for
    # text data too: one rule for every kind of data. Before, instruct data took the folder's
    # tokenizer.json and text data said the folder "does not exist".
    folder = RECIPES / "data" / "tiny-llama-hf"
    assert invoke("config", "text-demo", f"data.tokenizer={folder}").exit_code == 0
    text = "The keeper wrote the time in the book."
    assert (build_tokenizer(str(folder)).encode(text).tolist()
            == build_tokenizer(str(folder / "tokenizer.json")).encode(text).tolist())  # fmt: skip
    one_line_error(
        invoke("config", "text-demo", f"data.tokenizer={tmp_path}"),
        f"tokenizer {tmp_path}/tokenizer.json does not exist (a tokenizer.json, a folder holding "
        "one, or `byte`)",
    )


# Llama 3's pre-tokenizer split (also Mistral's Tekken); Qwen 2 differs in `\p{N}`.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip


def trained_tokenizer(kind: str, text: str):
    """A small BPE tokenizer trained on `text`, with the pre-tokenizer of a model family:
    `gpt2` (byte-level, GPT-2's regex), `llama3` (Llama 3's split regex, then bytes),
    `metaspace-first`/`-always` (SentencePiece's ▁, split at each), `metaspace-unsplit` (▁ but
    one word per text: no place to cut it)."""
    tk = pytest.importorskip("tokenizers")
    pre = tk.pre_tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = {
        "gpt2": lambda: pre.ByteLevel(add_prefix_space=False),
        "llama3": lambda: pre.Sequence([pre.Split(tk.Regex(LLAMA3_SPLIT), "isolated"),
                                        pre.ByteLevel(add_prefix_space=False, use_regex=False)]),
        "metaspace-first": lambda: pre.Metaspace(prepend_scheme="first"),
        "metaspace-always": lambda: pre.Metaspace(prepend_scheme="always"),
        "metaspace-unsplit": lambda: pre.Metaspace(prepend_scheme="first", split=False),
    }[kind]()  # fmt: skip
    alphabet = pre.ByteLevel.alphabet() if kind in ("gpt2", "llama3") else []
    trainer = tk.trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet,
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([text], trainer)
    return tok


@pytest.mark.parametrize("setting", ["truncation", "padding"])
def test_tokenizer_json_truncation_and_padding_do_not_change_the_data(tmp_path, setting):
    corpus = (RECIPES / "data/tiny.txt").read_text()
    tok = trained_tokenizer("llama3", corpus)
    docs = [d for d in corpus.split("\n\n") if d][:6]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    eos = tok.token_to_id("<|endoftext|>")
    want = [i for d in docs for i in (*tok.encode(d, add_special_tokens=False).ids, eos)]
    assert len(want) > 6 * 64  # documents longer than the truncation below
    # Settings for batches of model inputs, saved in the file: they must not cut or pad data.
    if setting == "truncation":
        tok.enable_truncation(max_length=16)
    else:
        tok.enable_padding(pad_id=eos, pad_to_multiple_of=64)
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "out"
    result = invoke("prepare-data", str(tmp_path / "docs.jsonl"), "--out", str(out),
                    "--tokenizer", str(tmp_path / "tokenizer.json"))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert read_tokens(out / "train.bin", "uint16") == want


@pytest.mark.parametrize(
    "kind", ["gpt2", "llama3", "metaspace-first", "metaspace-always", "metaspace-unsplit"]
)
def test_a_long_txt_file_gets_the_tokens_of_the_whole_text(tmp_path, monkeypatch, kind):
    # The shipped corpus with what pieces must not be cut in: CRLF, blank lines, trailing
    # spaces, indentation, runs of spaces. The tokenizer learns merges of them.
    base = (RECIPES / "data/tiny.txt").read_text()
    variants = (("\n", "\r\n"), ("\n", "\n\n"), ("\n", "  \n"), ("\n", "\n    "), (". ", ".  "))
    text = base + "".join(base.replace(a, b) for a, b in variants)
    tok = trained_tokenizer(kind, text)
    tok.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "long.txt"
    path.write_bytes(text.encode())
    monkeypatch.setattr(text_data, "TXT_CHUNK_CHARS", 512)  # pieces of ~512 characters
    hf = build_tokenizer(str(tmp_path / "tokenizer.json"))
    want = [*tok.encode(text, add_special_tokens=False).ids, tok.token_to_id("<|endoftext|>")]
    assert tokenize_to_array([path], hf, "text").tolist() == want
    # The file was read in pieces where a cut cannot change the tokens (none: read whole).
    (pieces,) = iter_documents(path, "text", cuts=hf.cuts)
    pieces = list(pieces)
    assert "".join(pieces) == text
    assert len(pieces) == 1 if kind == "metaspace-unsplit" else len(pieces) > 10


def test_tokenizer_path_without_the_tokenizers_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(UserError, match=r"needs the `tokenizers` package: pip install"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


# --------------------------------------------------------------------------------------------
# The sample order


def windows_dataset(seed: int, n_tokens: int = 101, seq_len: int = 4) -> ShuffledWindows:
    arrays = [np.arange(n_tokens, dtype=np.uint16), np.arange(1000, 1000 + 9, dtype=np.uint16)]
    windows = TokenWindows(arrays, seq_len=seq_len, names=["a", "b"])
    return ShuffledWindows(windows, range(windows.num_windows), seed=seed, stream="train",
                           vocab_size=2000, description="")  # fmt: skip


def test_sample_order_is_set_by_the_seed_alone():
    data = windows_dataset(seed=3)
    n = data.num_samples
    assert n == 25 + 2  # (101 - 1) // 4 windows, then (9 - 1) // 4: none spans the two files
    epoch0 = [data.sample(i) for i in range(n)]
    # Every window once per epoch; consecutive windows share one token; no mixed files.
    starts = sorted(int(s[0]) for s in epoch0)
    assert starts == [*range(0, 100, 4), 1000, 1004]
    assert all(len(s) == 5 and int(s[-1]) - int(s[0]) == 4 for s in epoch0)
    # Epoch 1: the same windows, another order.
    epoch1 = [data.sample(i) for i in range(n, 2 * n)]
    assert sorted(int(s[0]) for s in epoch1) == starts
    assert [int(s[0]) for s in epoch1] != [int(s[0]) for s in epoch0]
    # The same seed in a fresh object (another process, a resume) gives the same samples, read
    # in any order; another seed another order.
    again = windows_dataset(seed=3)
    for i in (40, 3, 26, 27, 0):
        assert torch.equal(again.sample(i), (epoch0 + epoch1)[i])
    other = windows_dataset(seed=4)
    assert [int(other.sample(i)[0]) for i in range(n)] != [int(s[0]) for s in epoch0]


def test_a_step_reads_the_same_windows_at_any_world_size():
    data = windows_dataset(seed=0)
    per_world = {}
    for world, micro in ((1, 8), (2, 1), (4, 2), (8, 1)):
        layout = BatchLayout(global_batch_size=8, micro_batch_size=micro, world_size=world)
        for step in (0, 3, 7):  # step 3 crosses into the second epoch (27 windows)
            got = [data.sample(i) for r in range(world) for m in range(layout.grad_accum_steps)
                   for i in layout.indices(step, m, r)]  # fmt: skip
            per_world.setdefault(step, []).append(sorted(tuple(t.tolist()) for t in got))
    for step, lists in per_world.items():
        assert all(x == lists[0] for x in lists), step


def test_validation_split_is_disjoint_and_fixed(tmp_path):
    cfg = load_recipe("tokens-demo", ["~data.val_paths", "data.val_fraction=0.25"]).config
    kwargs = dict(vocab_size=257, seq_len=cfg.train.seq_len, seed=0)
    train, val = build_datasets(cfg.data, **kwargs, with_val=True)
    train_only, none = build_datasets(cfg.data, **kwargs, with_val=False)
    assert none is None and train.num_samples == train_only.num_samples
    assert train.num_samples + val.num_samples == (4500 - 1) // 64
    assert set(val.ids).isdisjoint(train.ids)
    assert torch.equal(train.sample(5), train_only.sample(5))


def test_data_paths_are_relative_to_the_recipe_that_sets_them(tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    (sub / "d").mkdir(parents=True)
    shutil.copy(RECIPES / "data/tiny/train.bin", sub / "d/t.bin")
    (sub / "my.yaml").write_text("extends: tokens-demo\ndata:\n  paths: d/t.bin\n")
    cfg = load_recipe(str(sub / "my.yaml")).config
    assert cfg.data.paths == [str(sub / "d/t.bin")]
    assert cfg.data.val_paths == [str(RECIPES / "data/tiny/val.bin")]  # set by tokens-demo
    monkeypatch.chdir(sub)
    cfg = load_recipe("tokens-demo", ["data.val_paths=[d/t.bin]"]).config
    assert cfg.data.val_paths == [str(sub / "d/t.bin")]


# --------------------------------------------------------------------------------------------
# Mistakes: one line, exit 2, before anything starts


def test_bad_data_is_refused_before_launch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "f.npy", np.zeros(1000, dtype=np.float32))
    np.arange(11, dtype=np.uint16).tofile(tmp_path / "short.bin")
    cases = [
        (["data.paths=[nope.bin]"], f"data.paths: {tmp_path}/nope.bin does not exist"),
        (["data.paths=[f.npy]"], "holds a float32 array of shape (1000,); token files must be"),
        (["data.val_paths=[short.bin]"], "has 11 tokens, fewer than one sequence (train.seq_len"),
        (["model.vocab_size=256"], "tokenized with a 257-token vocabulary (tokenizer byte) but "
                                   "model.vocab_size is 256"),
        (["data.token_dtype=uint32"], "data.token_dtype is uint32 but"),
        (["~data.val_paths"], "eval.every_steps is 10 but there is no validation data"),
        (["data.paths=[short.bin]", "data.token_dtype=uint32"], "not a whole number of uint32"),
    ]  # fmt: skip
    for overrides, message in cases:
        result = invoke("train", "tokens-demo", *overrides, "--run-dir", "run")
        one_line_error(result, message)
    one_line_error(invoke("config", "text-demo", "model.vocab_size=200"),
                   "data.tokenizer byte has 257 tokens but model.vocab_size is 200")  # fmt: skip
    one_line_error(invoke("config", "text-demo", "train.seq_len=64", "data.paths=[f.npy]"),
                   "is not a text file (.txt or .jsonl)")  # fmt: skip
    assert not (tmp_path / "run").exists()
    # The launcher checks again: a file gone since the recipe was resolved.
    shutil.copy(RECIPES / "data/tiny/train.bin", tmp_path / "t.bin")
    resolved = load_recipe("tokens-demo", ["data.paths=[t.bin]"])
    (tmp_path / "t.bin").unlink()
    with pytest.raises(UserError, match="t.bin does not exist"):
        launch_training(resolved, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_text_split_and_length_are_checked_before_launch_for_every_tokenizer(tmp_path):
    # Four short documents (.jsonl): a few windows of 65 tokens, 0.1 of them is no validation.
    texts = [f"Note {i}: " + "calm sea. " * 6 for i in range(4)]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    n = (sum(len(t.encode()) + 1 for t in texts) - 1) // 64  # byte tokens, end-of-text each
    assert round(n * 0.1) == 0
    split_error = (f"data.val_fraction=0.1 of {n} windows leaves 0 for validation and {n} for "
                   "training")  # fmt: skip
    proc = run_fsdprun("train", "text-demo", f"data.paths=[{docs}]", "--run-dir",
                       str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: {split_error}; both need at least one (change the fraction, or use data.val_paths)"
    ]
    assert not (tmp_path / "run").exists()
    one_line_error(invoke("config", "text-demo", f"data.paths=[{docs}]"), split_error)
    # A tokenizer.json: its token count, not the file size, decides.
    tok = trained_tokenizer("llama3", (RECIPES / "data/tiny.txt").read_text())
    tok.save(str(tmp_path / "tokenizer.json"))
    text = "The keeper wrote the time in the book, then the wind. " * 2
    (tmp_path / "a.txt").write_text(text)
    num_tokens = len(tok.encode(text).ids) + 1
    assert num_tokens < 33 < len(text)
    one_line_error(
        invoke("config", "text-demo", f"data.paths=[{tmp_path}/a.txt]", "model.vocab_size=600",
               f"data.tokenizer={tmp_path}/tokenizer.json", "train.seq_len=32"),
        f"data.paths: {num_tokens} tokens in all, fewer than one sequence (train.seq_len + 1 = 33)",
    )  # fmt: skip


def test_the_text_the_checks_tokenize_is_the_text_the_workers_train_on(tmp_path, monkeypatch):
    # The launcher's checks and a worker in its process (forked, or a torchrun rank) tokenize
    # each document once between them; before, the worker tokenized it all again. A spawned
    # worker reads what the launcher saved in RUN_DIR/tokenized (as the elastic launcher does
    # before it spawns). A file that changes is tokenized afresh, saved tokens or not.
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(6)))
    encoded = []
    encode = text_data.ByteTokenizer.encode
    monkeypatch.setattr(text_data.ByteTokenizer, "encode",
                        lambda tok, text: encoded.append(text) or encode(tok, text))  # fmt: skip
    overrides = [f"data.paths=[{docs}]", "data.val_fraction=0", "eval.every_steps=0"]
    cfg = load_recipe("text-demo", overrides).config
    assert check_data(cfg) == [] and check_data(cfg) == []  # `train` checks twice
    train, _ = build_datasets(cfg.data, vocab_size=257, seq_len=cfg.train.seq_len, seed=0)
    assert len(encoded) == 6 and train.num_samples > 0
    saved = tmp_path / "run" / "tokenized"
    save_tokenized(cfg.data, saved)  # and this process lets its copy go
    spawned, _ = build_datasets(cfg.data, vocab_size=257, seq_len=cfg.train.seq_len, seed=0,
                                saved=saved)  # fmt: skip
    assert len(encoded) == 6
    assert [spawned.sample(i).tolist() for i in range(spawned.num_samples)] == [
        train.sample(i).tolist() for i in range(train.num_samples)
    ]
    docs.write_text(docs.read_text() + json.dumps({"text": "one more " * 20}) + "\n")
    again, _ = build_datasets(cfg.data, vocab_size=257, seq_len=cfg.train.seq_len, seed=0,
                              saved=saved)  # fmt: skip
    assert len(encoded) == 6 + 7 and again.windows.num_windows > train.windows.num_windows


def test_prepare_data_refuses_a_split_that_leaves_nothing_and_writes_nothing(tmp_path):
    (tmp_path / "a.txt").write_text("hello")  # 5 bytes + end-of-text: 6 tokens
    for fraction, message in (
        ("0.95", "--val-fraction 0.95 of 6 tokens leaves 6 for validation and 0 for training"),
        ("0.05", "--val-fraction 0.05 of 6 tokens leaves 0 for validation and 6 for training"),
    ):
        result = invoke("prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"),
                        "--val-fraction", fraction)  # fmt: skip
        one_line_error(result, message)
        assert not (tmp_path / "out").exists()
    # A bad document after some were written: nothing is left behind, an empty OUT stays.
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\nnot json\n')
    (tmp_path / "empty").mkdir()
    result = invoke("prepare-data", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--out",
                    str(tmp_path / "empty"))  # fmt: skip
    one_line_error(result, "b.jsonl line 2: not JSON")
    assert list((tmp_path / "empty").iterdir()) == []


# --------------------------------------------------------------------------------------------
# Real runs

# 8 steps, a checkpoint every 4, validation every 4 (and after the last step).
BASE = ("train.steps=8", "checkpoint.every_steps=4", "output.log_every=1",
        "train.micro_batch_size=1", "eval.every_steps=4")  # fmt: skip


def by_step(run_dir: Path, event: str, field: str) -> dict[int, float]:
    # A resumed run appends to metrics.jsonl: later records of a step win.
    return {e["step"]: e[field] for e in Run(None, run_dir).events if e["event"] == event}


def test_token_data_resumes_exactly_at_another_world_size(tmp_path):
    straight = run_fsdprun("train", "tokens-demo", *BASE, "--run-dir", str(tmp_path / "a"),
                           cwd=tmp_path)  # fmt: skip
    Run(straight, tmp_path / "a").check()
    assert "eval step 4 | val loss" in straight.stdout and "final val loss" in straight.stdout
    crashed = run_fsdprun(
        "train", "tokens-demo", *BASE, "--run-dir", str(tmp_path / "b"), cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_FAIL_AT="0:5"),
    )  # fmt: skip
    assert crashed.returncode == 1 and "injected failure at step 5" in crashed.stderr
    resumed = run_fsdprun("resume", str(tmp_path / "b"), "--nproc-per-node", "1", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    want, got = by_step(tmp_path / "a", "step", "loss"), by_step(tmp_path / "b", "step", "loss")
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step
    want_val = by_step(tmp_path / "a", "eval", "val_loss")
    got_val = by_step(tmp_path / "b", "eval", "val_loss")
    assert sorted(want_val) == sorted(got_val) == [4, 8]
    assert all(math.isfinite(v) for v in got_val.values())
    assert got_val[8] == pytest.approx(want_val[8], abs=1e-5)
    manifest = list_checkpoints(tmp_path / "b")[-1].manifest
    assert manifest["world_size"] == 1 and manifest["train_state"]["data_position"] == 64
    summary = Run(None, tmp_path / "b").summary
    assert summary["final_val_loss"] == pytest.approx(want_val[8], abs=1e-5)


def test_text_demo_runs_as_shipped(tmp_path):
    proc = run_fsdprun("train", "text-demo", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    run = Run(proc, tmp_path / "run").check()
    assert "data: text (byte tokenizer): 1 file(s), 70 windows of 65 tokens" in proc.stdout
    val = by_step(run.run_dir, "eval", "val_loss")
    assert sorted(val) == [10, 20, 30, 40] and val[40] < val[10] < math.log(257)
    assert run.losses[-1] < run.losses[0]
