"""Fine-tuning data: chat/instruct/hf_dataset examples, loss masks against a hand-built reference,
packing and padding, truncation counts, the order at any world size, prepared folders, and the
checks before launch (one line, exit 2)."""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import fsdprun_env
from typer.testing import CliRunner

from fsdprun.cli import app
from fsdprun.config import ChatTurns, DataConfig, DataSource, Truncate
from fsdprun.data import IGNORE_INDEX, BatchLayout, build_datasets, load_batch, sft_examples
from fsdprun.data.prepared import prepare_sft_examples
from fsdprun.data.sft_examples import tokenize_examples
from fsdprun.data.text import ByteTokenizer, HFTokenizer
from fsdprun.errors import UserError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TINY = RECIPES / "data" / "tiny-llama-hf"
CHAT = RECIPES / "data" / "chat.jsonl"
EOS = 256
CPU = torch.device("cpu")

CONVERSATIONS = [
    [("user", "hi"), ("assistant", "hello!")],
    [("system", "be brief"), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?"),
     ("assistant", "6, naïvely")],
    [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "dd"), ("user", "e"),
     ("assistant", "fff")],
]  # fmt: skip
PAIRS = [("Say hi", "hi"), ("Translate 'chat'", "cat, ou chat"), ("", "empty prompt")]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_records() -> list[dict]:
    return [{"messages": [{"role": r, "content": c} for r, c in conv]} for conv in CONVERSATIONS]


def chat_reference(conv, turns: str) -> tuple[list[int], list[bool]]:
    """The tiny model's template written out by hand: `<|role|>\\n` then the content; assistant
    content ends with end-of-text (and trains, every turn or the last), others with `\\n`."""
    last = max(i for i, (role, _) in enumerate(conv) if role == "assistant")
    ids, mask = [], []
    for i, (role, content) in enumerate(conv):
        head = list(f"<|{role}|>\n".encode())
        ids += head
        mask += [False] * len(head)
        if role == "assistant":
            body = [*content.encode(), EOS]
            ids += body
            mask += [turns == "all" or i == last] * len(body)
        else:
            body = list(f"{content}\n".encode())
            ids += body
            mask += [False] * len(body)
    return ids, mask


def chat_config(paths, **kw) -> DataConfig:
    return DataConfig(
        source=DataSource.chat, paths=[str(p) for p in paths], tokenizer=str(TINY), **kw
    )


def examples_of(ex) -> list[tuple[list[int], list[bool]]]:
    o = ex.offsets
    return [
        (ex.tokens[o[k] : o[k + 1]].tolist(), ex.mask[o[k] : o[k + 1]].astype(bool).tolist())
        for k in range(ex.num_examples)
    ]


# --------------------------------------------------------------------------------------------
# Tokenizer and masks


def test_tiny_model_tokenizer_json_is_the_byte_tokenizer():
    hf, byte = HFTokenizer(TINY / "tokenizer.json"), ByteTokenizer()
    rng = np.random.default_rng(0)
    random_text = bytes(rng.integers(0, 256, 2000, dtype=np.uint8)).decode("utf-8", "replace")
    for text in ["plain ASCII, digits 0123 and\ttabs\n", "naïve café — 日本語 🙂", random_text]:
        assert hf.encode(text).tolist() == byte.encode(text).tolist() == list(text.encode())
    assert (hf.vocab_size, hf.eos_id) == (byte.vocab_size, byte.eos_id) == (257, EOS)


@pytest.mark.parametrize("turns", ["all", "last"])
def test_chat_mask_is_the_assistant_turns(tmp_path, turns):
    path = write_jsonl(tmp_path / "c.jsonl", chat_records())
    ex, _ = tokenize_examples(
        [str(path)], chat_config([path], chat_turns=ChatTurns(turns)), key="k"
    )
    assert examples_of(ex) == [chat_reference(conv, turns) for conv in CONVERSATIONS]


OPENS_WITH_ASSISTANT = [
    [("assistant", "How can I help?"), ("user", "say hi"), ("assistant", "hi")],
    [("assistant", "only me")],
]


def test_an_opening_assistant_turn_trains_its_content_not_its_header(tmp_path):
    # Issue 20: the header `<|assistant|>\n` of an opening assistant turn trained as if it were
    # response text. Every path that tokenizes chat rows: chat files, hf_dataset rows, and
    # prepare-data --source chat.
    records = [{"messages": [{"role": r, "content": c} for r, c in conv]}
               for conv in OPENS_WITH_ASSISTANT]  # fmt: skip
    expected = [chat_reference(conv, "all") for conv in OPENS_WITH_ASSISTANT]
    assert [sum(m) for _, m in expected] == [len("How can I help?") + 1 + 3, len("only me") + 1]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    ex, _ = tokenize_examples([str(path)], chat_config([path]), key="k")
    assert examples_of(ex) == expected
    hf = DataConfig(source=DataSource.hf_dataset, paths=[str(path)], tokenizer=str(TINY))
    assert examples_of(tokenize_examples(hf.paths, hf, key="k")[0]) == expected
    out = tmp_path / "p"
    result = CliRunner().invoke(app, [
        "prepare-data", str(path), "--out", str(out), "--source", "chat", "--tokenizer", str(TINY),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    mask = np.fromfile(out / "train.mask.bin", dtype=np.uint8).astype(bool).tolist()
    assert mask == [m for _, ms in expected for m in ms]


def test_instruct_mask_is_the_response_and_end_of_text(tmp_path):
    records = [{"q": p, "a": r, "other": 1} for p, r in PAIRS]
    path = write_jsonl(tmp_path / "i.jsonl", records)
    template = "Q: {prompt}\nA: "
    cfg = DataConfig(
        source=DataSource.instruct, paths=[str(path)], prompt_field="q", response_field="a",
        template=template,
    )  # fmt: skip
    ex, _ = tokenize_examples(cfg.paths, cfg, key="k")
    expected = []
    for p, r in PAIRS:
        head, body = list(template.replace("{prompt}", p).encode()), [*r.encode(), EOS]
        expected.append((head + body, [False] * len(head) + [True] * len(body)))
    assert examples_of(ex) == expected


def test_a_template_whose_renderings_do_not_extend_each_other_is_refused(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(TINY, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # Starts with the message count: rendering fewer messages is no prefix of the whole.
    config["chat_template"] = "{{ messages|length }}" + config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_jsonl(tmp_path / "c.jsonl", chat_records()[:1])
    cfg = DataConfig(source=DataSource.chat, paths=[str(path)], tokenizer=str(folder))
    with pytest.raises(UserError, match="does not render a conversation as its first messages"):
        tokenize_examples(cfg.paths, cfg, key="k")


# --------------------------------------------------------------------------------------------
# Rows


def check_rows(data, examples, seq_len: int) -> list[tuple]:
    """Every row's invariants; returns the examples (tokens, mask) found in rows, in order."""
    found = []
    for i in range(data.num_samples):
        row = data.sample(i)
        tokens, targets = row.tokens.tolist(), row.targets.tolist()
        doc, pos = row.doc_ids.tolist(), row.positions.tolist()
        assert len(tokens) == seq_len + 1 and len(targets) == len(doc) == len(pos) == seq_len
        t = 0
        while t < seq_len:
            if doc[t] == -1:  # padding to the end: never trained
                assert set(doc[t:seq_len]) == {-1} and set(targets[t:]) == {IGNORE_INDEX}
                break
            start = t
            while t < seq_len and doc[t] == doc[start]:
                t += 1
            # Positions restart with each example and count up.
            assert pos[start:t] == list(range(t - start))
            # It ends where the next document starts; at the row's end the last token (which
            # has no document id: it is no input) may belong to it or be padding.
            ends = [t + 1, t] if t == seq_len else [t]
            match = [(end, e) for end in ends for e in examples if e[0] == tokens[start:end]]
            assert match, "a row segment is a whole example"
            end, (_, mask) = match[0]
            for j in range(start, t):
                inside = j + 1 < end
                want = tokens[j + 1] if inside and mask[j + 1 - start] else IGNORE_INDEX
                assert targets[j] == want, (i, j)  # never across an example, never a prompt
            found.append((tuple(tokens[start:end]), tuple(mask)))
    return found


@pytest.mark.parametrize("pack", [True, False])
def test_rows_hold_whole_examples_with_masks_positions_and_documents(tmp_path, pack):
    records = chat_records() * 4
    path = write_jsonl(tmp_path / "c.jsonl", records)
    seq_len = 89  # examples of 33, 94 and 84 tokens: the second is dropped
    cfg = chat_config([path], pack=pack)
    data, _ = build_datasets(cfg, vocab_size=257, seq_len=seq_len, seed=3)
    refs = [chat_reference(conv, "all") for conv in CONVERSATIONS] * 4
    found = check_rows(data, refs, seq_len)
    # Each example fitting a row is in exactly one row per epoch; the others are dropped.
    fitting = sorted((tuple(t), tuple(m)) for t, m in refs if len(t) <= seq_len + 1)
    assert sorted(found) == fitting and len(fitting) < len(refs)
    assert data.counts.dropped == len(refs) - len(fitting)
    if pack:
        assert data.num_samples < len(fitting)  # several examples share rows
        assert any(data.sample(i).doc_ids.max() > 0 for i in range(data.num_samples))
    else:
        assert data.num_samples == len(fitting)


def test_truncate_drop_and_cut_are_counted(tmp_path):
    lengths = [10, 20, 40, 80]  # response lengths: with a 2-byte template + eos
    records = [{"prompt": "p", "response": "r" * n} for n in lengths]
    records.append({"prompt": "x" * 60, "response": "y"})  # a long prompt: cutting leaves no target
    path = write_jsonl(tmp_path / "i.jsonl", records)
    base = dict(source=DataSource.instruct, paths=[str(path)], template="{prompt}|")
    seq_len = 31  # rows of 32 tokens: examples of 13 and 23 tokens fit
    drop, _ = build_datasets(DataConfig(**base), vocab_size=257, seq_len=seq_len, seed=0)
    assert (drop.counts.kept, drop.counts.dropped, drop.counts.truncated) == (2, 3, 0)
    assert drop.counts.trained_tokens == (10 + 1) + (20 + 1)
    cut, _ = build_datasets(
        DataConfig(**base, truncate=Truncate.truncate), vocab_size=257, seq_len=seq_len, seed=0
    )
    assert (cut.counts.kept, cut.counts.dropped, cut.counts.truncated) == (4, 1, 2)
    assert cut.counts.trained_tokens == 11 + 21 + 2 * (32 - 2)  # a cut one: all but "p|"
    assert "5 examples, 4 kept, 1 dropped, 2 truncated" in cut.description
    for i in range(cut.num_samples):
        assert (cut.sample(i).targets != IGNORE_INDEX).any()


def test_the_global_sample_set_is_the_same_at_any_world_size_and_set_by_the_seed():
    cfg = chat_config([CHAT])
    data, _ = build_datasets(cfg, vocab_size=257, seq_len=255, seed=7)
    again, _ = build_datasets(cfg, vocab_size=257, seq_len=255, seed=7)
    other, _ = build_datasets(cfg, vocab_size=257, seq_len=255, seed=8)
    steps, global_batch = 3, 8

    def per_index(world: int, micro: int) -> dict[int, tuple]:
        layout = BatchLayout(
            global_batch_size=global_batch, micro_batch_size=micro, world_size=world
        )
        seen = {}
        for step in range(steps):
            for m in range(layout.grad_accum_steps):
                for rank in range(world):
                    idx = layout.indices(step, m, rank)
                    b = load_batch(data, idx, CPU)
                    for k, i in enumerate(idx):
                        seen[i] = tuple(
                            t[k].tolist() for t in (b.inputs, b.targets, b.positions, b.doc_ids)
                        )
        return seen

    one = per_index(1, 8)
    assert sorted(one) == list(range(steps * global_batch))
    assert per_index(2, 2) == one and per_index(4, 1) == one
    # Past one epoch the rows come back in another order.
    n = data.num_samples
    assert steps * global_batch < n
    rows = [tuple(data.sample(i).tokens.tolist()) for i in range(2 * n)]
    assert sorted(rows[:n]) == sorted(rows[n:]) and rows[:n] != rows[n:]
    assert all(torch.equal(data.sample(i).tokens, again.sample(i).tokens) for i in range(n))
    assert any(not torch.equal(data.sample(i).tokens, other.sample(i).tokens) for i in range(n))


def test_windows_batches_keep_plain_targets():
    from fsdprun.config import load_recipe

    cfg = load_recipe("debug").config
    data, _ = build_datasets(cfg.data, vocab_size=256, seq_len=16, seed=0)
    b = load_batch(data, range(2), CPU)
    tokens = torch.stack([data.sample(i) for i in range(2)])
    assert torch.equal(b.inputs, tokens[:, :-1]) and torch.equal(b.targets, tokens[:, 1:])
    assert b.positions is None and b.doc_ids is None


# --------------------------------------------------------------------------------------------
# Prepared folders and local HF datasets


def all_rows(data) -> list[tuple]:
    return [
        tuple(tuple(t.tolist()) for t in (r.tokens, r.targets, r.positions, r.doc_ids))
        for r in (data.sample(i) for i in range(data.num_samples))
    ]


def test_a_prepared_folder_trains_the_same_rows_without_tokenizing(tmp_path, monkeypatch):
    result = CliRunner().invoke(app, [
        "prepare-data", str(CHAT), "--out", str(tmp_path / "p"), "--source", "chat",
        "--tokenizer", str(TINY), "--val-fraction", "0.1", "--chat-turns", "last",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "train.bin (108 examples" in result.output
    live_cfg = chat_config([CHAT], chat_turns=ChatTurns.last, val_fraction=0.1)
    live = build_datasets(live_cfg, vocab_size=257, seq_len=200, seed=1, with_val=True)

    def no_tokenizing(*a, **k):
        raise AssertionError("a prepared folder is not tokenized again")

    monkeypatch.setattr(sft_examples, "tokenize_examples", no_tokenizing)
    monkeypatch.setattr("fsdprun.data.spec.tokenize_examples", no_tokenizing)
    prepared_cfg = DataConfig(
        source=DataSource.tokens, paths=[str(tmp_path / "p" / "train.bin")],
        val_paths=[str(tmp_path / "p" / "val.bin")], chat_turns=ChatTurns.last,
    )  # fmt: skip
    prepared = build_datasets(prepared_cfg, vocab_size=257, seq_len=200, seed=1, with_val=True)
    for a, b in zip(live, prepared, strict=True):
        assert all_rows(a) == all_rows(b)
        assert a.counts == b.counts
    assert isinstance(prepared[0].examples.tokens, np.memmap)


def test_hf_dataset_from_save_to_disk_equals_the_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    records = chat_records() * 2
    path = write_jsonl(tmp_path / "c.jsonl", records)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    hf_cfg = DataConfig(
        source=DataSource.hf_dataset, paths=[str(tmp_path / "saved")], tokenizer=str(TINY)
    )
    hf, _ = build_datasets(hf_cfg, vocab_size=257, seq_len=127, seed=0)
    ref, _ = build_datasets(chat_config([path]), vocab_size=257, seq_len=127, seed=0)
    assert all_rows(hf) == all_rows(ref)
    # Instruct-shaped rows from a parquet file, read by datasets and (source instruct) pyarrow.
    pairs = [{"prompt": p, "response": r} for p, r in PAIRS]
    datasets.Dataset.from_list(pairs).to_parquet(str(tmp_path / "i.parquet"))
    write_jsonl(tmp_path / "i.jsonl", pairs)
    got = []
    for source, file in [
        ("hf_dataset", "i.parquet"),
        ("instruct", "i.parquet"),
        ("instruct", "i.jsonl"),
    ]:
        cfg = DataConfig(source=DataSource(source), paths=[str(tmp_path / file)])
        got.append(all_rows(build_datasets(cfg, vocab_size=257, seq_len=63, seed=0)[0]))
    assert got[0] == got[1] == got[2]


def test_a_hub_name_is_refused_without_downloading(tmp_path):
    cfg = DataConfig(source=DataSource.hf_dataset, paths=[str(tmp_path / "tatsu-lab/alpaca")])
    with pytest.raises(UserError, match="is not a local file or folder; fsdprun never downloads"):
        build_datasets(cfg, vocab_size=257, seq_len=63, seed=0)


# --------------------------------------------------------------------------------------------
# Checks before launch


def _no_template(tmp: Path) -> str:
    folder = tmp / "notemplate"
    folder.mkdir()
    shutil.copy(TINY / "tokenizer.json", folder)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


# (case, data lines or None, extra recipe lines, the message's distinctive part)
BAD = [
    ("no-assistant", ['{"messages": [{"role": "user", "content": "hi"}]}'], "",
     "d.jsonl line 4: no assistant turn"),
    ("no-messages", ['{"text": "hi"}'], "", "line 4: no `messages` list"),
    ("bad-message", ['{"messages": [{"role": "user"}]}'], "", 'message 0 is not {"role"'),
    ("not-json", ["{oops"], "", "line 4: not JSON"),
    ("no-template", None, "  tokenizer: NOTEMPLATE\n", "has no chat_template"),
    ("byte-tokenizer", None, "  tokenizer: byte\n", "data.tokenizer is byte, which has no chat"),
    ("missing-field", ['{"prompt": "a", "answer": "b"}'], "  source: instruct\n",
     "no text field 'response'"),
    ("template-without-prompt", ['{"prompt": "a", "response": "b"}'],
     "  source: instruct\n  template: 'Q:'\n", "has no {prompt}"),
    ("hub-name", None, "  source: hf_dataset\n  paths: [tatsu-lab/alpaca]\n",
     "fsdprun never downloads"),
    ("missing-file", None, "  paths: [nothere.jsonl]\n", "nothere.jsonl is not a local file"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "lines", "extra", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_fine_tuning_data_is_one_line_before_launch(tmp_path, case, lines, extra, message):
    good = [] if "instruct" in extra else CHAT.read_text().splitlines()[:3]
    (tmp_path / "d.jsonl").write_text("\n".join(good + (lines or [])) + "\n")
    extra = extra.replace("NOTEMPLATE", _no_template(tmp_path)) if "NOTEMPLATE" in extra else extra
    data = "data:\n  source: chat\n  paths: [d.jsonl]\n" + f"  tokenizer: {TINY}\n" * (
        "tokenizer:" not in extra
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: debug\nmodel:\n  vocab_size: 257\n" + _merge(data, extra))
    result = CliRunner().invoke(app, ["config", str(recipe)])
    assert result.exit_code == 2, (result.output, result.exception)
    lines_out = result.stderr.strip().splitlines()
    assert len(lines_out) == 1 and lines_out[0].startswith("error: "), result.stderr
    assert message in lines_out[0], lines_out[0]


def _merge(data: str, extra: str) -> str:
    """`data` with the keys of `extra` replacing its own."""
    keys = {line.split(":")[0] for line in extra.splitlines()}
    kept = [line for line in data.splitlines() if line.split(":")[0] not in keys]
    return "\n".join(kept + extra.splitlines()) + "\n"


def test_the_shipped_chat_file_passes_the_checks(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "extends: debug\nmodel:\n  vocab_size: 257\n  max_seq_len: 256\n"
        f"data:\n  source: chat\n  paths: [{CHAT}]\n"
        f"  tokenizer: {TINY}\n  val_fraction: 0.1\ntrain:\n  seq_len: 255\n"
    )
    result = CliRunner().invoke(app, ["config", str(recipe)])
    assert result.exit_code == 0, result.output


# (case, recipe lines beside three conversations of the shipped chat file, the message's start;
# None: the checks pass). Fitting, split and vocabulary are what rows would refuse.
ROW_CHECKS = [
    ("fine", "", None),
    ("no-example-fits", "train:\n  seq_len: 8\n",
     "train data: none of its 3 examples fits train.seq_len + 1 = 9 tokens"),
    ("no-val-example-fits", "data:\n  val_paths: [long.jsonl]\n",
     "val data: none of its 1 examples fits train.seq_len + 1 = 256 tokens"),
    ("split", "data:\n  val_fraction: 0.1\n",
     "data.val_fraction=0.1 of 3 examples leaves 0 for validation and 3 for training"),
    ("val-file", "data:\n  val_paths: [nothere.jsonl]\n", "data.val_paths: "),
    # The training examples are checked before data.val_paths is read, as the rows are built.
    ("train-before-val", "train:\n  seq_len: 8\ndata:\n  val_paths: [nothere.jsonl]\n",
     "train data: none of its 3 examples fits"),
    ("vocabulary", "model:\n  vocab_size: 100\n", "data: the examples hold token id"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "extra", "message"), ROW_CHECKS, ids=[c[0] for c in ROW_CHECKS])
def test_the_preflight_checks_examples_as_rows_take_them_and_builds_no_rows(
    tmp_path, monkeypatch, case, extra, message
):
    (tmp_path / "d.jsonl").write_text("\n".join(CHAT.read_text().splitlines()[:3]) + "\n")
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                           "content": "word " * 300}]}  # fmt: skip
    write_jsonl(tmp_path / "long.jsonl", [long])
    sections = {
        "model": {"vocab_size": 257, "max_seq_len": 256},
        "train": {"seq_len": 255},
        "data": {"source": "chat", "paths": ["d.jsonl"], "tokenizer": str(TINY)},
    }
    for section, values in (yaml.safe_load(extra) or {}).items():
        sections[section].update(values)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: debug\n" + yaml.safe_dump(sections))

    def no_rows(*args, **kwargs):
        raise AssertionError("the preflight builds no rows")

    monkeypatch.setattr("fsdprun.data.sft.SFTData.__init__", no_rows)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["config", str(recipe)])
    if message is None:
        assert result.exit_code == 0, (result.output, result.exception)
        return
    assert result.exit_code == 2, (result.output, result.exception)
    lines_out = result.stderr.strip().splitlines()
    assert len(lines_out) == 1 and lines_out[0].startswith(f"error: {message}"), result.stderr


# `fsdprun ARGS` run in this process as the console script runs it (the launcher's preflight
# here, its workers forked from it), with each conversation tokenized written down by the
# process that tokenized it.
COUNTING_FSDPRUN = """
import os, sys
from fsdprun.data import sft_examples
from fsdprun.cli import main

tokenize_chat = sft_examples.tokenize_chat
launcher = os.getpid()

def counted(*args, **kwargs):
    with open(os.environ["TOKENIZED_BY"], "a") as f:
        f.write("launcher\\n" if os.getpid() == launcher else f"worker {os.getpid()}\\n")
    return tokenize_chat(*args, **kwargs)

sft_examples.tokenize_chat = counted
sys.argv = ["fsdprun", *sys.argv[1:]]
main()
"""


def test_a_chat_file_is_tokenized_once_by_the_launcher_and_reused_by_its_workers(tmp_path):
    # Before: the launcher tokenized every conversation for its checks, then each worker did
    # again (3 times on 2 ranks, 0.35 s each for the shipped file and ~90 s for the launcher's
    # first on a busy 2-core machine); the workers now train on what the preflight tokenized.
    tokenized_by = tmp_path / "tokenized-by"
    proc = subprocess.run(
        [sys.executable, "-c", COUNTING_FSDPRUN, "train", "sft-demo", "train.steps=1",
         "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=fsdprun_env(TOKENIZED_BY=str(tokenized_by)), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2
    num_conversations = len(CHAT.read_text().splitlines())
    by = collections.Counter(tokenized_by.read_text().splitlines())
    assert by == {"launcher": num_conversations}, by


# A sitecustomize for every Python process the command starts (the launcher, and workers started
# by `spawn`, which inherit nothing of it): each conversation tokenized is written down with the
# process that tokenized it.
COUNTING_SITE = """
import os
from fsdprun.data import sft_examples

tokenize_chat = sft_examples.tokenize_chat

def counted(*args, **kwargs):
    with open(os.environ["TOKENIZED_BY"], "a") as f:
        f.write(f"rank {os.environ['RANK']}\\n" if "RANK" in os.environ else "launcher\\n")
    return tokenize_chat(*args, **kwargs)

sft_examples.tokenize_chat = counted
"""


def test_spawned_workers_train_on_what_the_launcher_tokenized(tmp_path):
    # Before: a spawned worker (the start method on accelerators) inherits nothing, so the
    # launcher let its tokens go and every worker tokenized the chat file again. Now the
    # launcher saves them in RUN_DIR/tokenized, the workers memory-map them, and the launcher
    # deletes them when the run ends.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(COUNTING_SITE)
    tokenized_by = tmp_path / "tokenized-by"
    # One rank, and a model of its own (sft-demo's HF model loads its weights): the launcher's
    # tokens are what is measured. The real `fsdprun` script: a sitecustomize needs a fresh
    # interpreter, which the suite's zygote would exec anyway.
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("fsdprun")), "train", "sft-demo", "train.steps=1",
         "eval.every_steps=0", "model.hf_path=null", "model.init=random", "model.max_seq_len=256",
         "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=fsdprun_env(FSDPRUN_START_METHOD="spawn", PYTHONPATH=str(site),
                        TOKENIZED_BY=str(tokenized_by)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    by = collections.Counter(tokenized_by.read_text().splitlines())
    assert by == {"launcher": len(CHAT.read_text().splitlines())}, by
    assert not (tmp_path / "run" / "tokenized").exists()  # no copy of the data left behind


def test_prepare_sft_examples_refuses_bad_choices(tmp_path):
    with pytest.raises(UserError, match="--chat-turns 'first' is not one of: all, last"):
        prepare_sft_examples([CHAT], tmp_path / "o", source="chat", tokenizer=str(TINY),
                             val_fraction=0, chat_turns="first")  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_no_target_crosses_into_an_example_that_trains_from_its_first_token(tmp_path):
    # An empty prompt and a bare "{prompt}" template: every token of an example is trained, so
    # only the document boundary keeps the last token of one example from predicting the next.
    records = [{"prompt": "", "response": "x" * n} for n in (5, 9, 14, 3, 7, 11)]
    path = write_jsonl(tmp_path / "i.jsonl", records)
    cfg = DataConfig(source=DataSource.instruct, paths=[str(path)], template="{prompt}")
    data, _ = build_datasets(cfg, vocab_size=257, seq_len=31, seed=0)
    refs = [([*b"x" * n, EOS], [True] * (n + 1)) for n in (5, 9, 14, 3, 7, 11)]
    found = check_rows(data, refs, 31)
    assert sorted(found) == sorted((tuple(t), tuple(m)) for t, m in refs)
    assert data.num_samples < len(refs)
