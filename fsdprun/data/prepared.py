"""The prepared folder of fine-tuning examples: `fsdprun prepare-data --source
chat|instruct|hf_dataset` writes the tokenized examples once (`prepare_sft_data`), and
`data.source: tokens` on its train.bin then trains without tokenizing (`open_prepared`):

    OUT/train.bin          token ids (uint16 or uint32, as data.json's dtype), all examples
    OUT/train.mask.bin     uint8, one per token: 1 = a target
    OUT/train.offsets.npy  int64 [num_examples + 1]: example k is tokens[offsets[k]:offsets[k+1]]
    OUT/val.*              the same for the validation examples (--val-fraction)
    OUT/data.json          {"format": "fsdprun-sft", "dtype", "vocab_size", "tokenizer", ...}

Fitting to a sequence length and packing happen at training time (`sft`), so one folder serves
any train.seq_len. The folder is written whole or not at all (`staging`). Never imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsdprun.config import CHAT_ROLES, ChatTurns, DataConfig, DataSource
from fsdprun.data.files import DESCRIPTION, read_description, token_dtype_for
from fsdprun.data.lazy_numpy import np
from fsdprun.data.sft_examples import SFT_SOURCES, Examples, tokenize_examples
from fsdprun.errors import UserError
from fsdprun.staging import staged_folder

SFT_FORMAT = "fsdprun-sft"


# --------------------------------------------------------------------------------------------
# Reading


def prepared_description(paths: list[str]) -> dict[str, Any] | None:
    """The data.json of a prepared fine-tuning folder whose files `paths` are, else None."""
    if not paths:
        return None
    desc = read_description(Path(paths[0]).parent)
    if desc is None or desc.get("format") != SFT_FORMAT:
        return None
    return desc


def open_prepared(path: Path, *, key: str) -> tuple[Examples, dict[str, Any]]:
    """The examples of a prepared train.bin / val.bin (memory-mapped: nothing read yet)."""
    desc = read_description(path.parent)
    if desc is None or desc.get("format") != SFT_FORMAT or path.name not in desc["files"]:
        raise UserError(
            f"{key}: {path} is not a file of a prepared fine-tuning folder (its data.json must "
            f"say format {SFT_FORMAT} and list it); list only such files"
        )
    stem = path.name.removesuffix(".bin")
    try:
        tokens = np.memmap(path, dtype=desc["dtype"], mode="r")
        mask = np.memmap(path.parent / f"{stem}.mask.bin", dtype=np.uint8, mode="r")
        offsets = np.load(path.parent / f"{stem}.offsets.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        raise UserError(f"{key}: {path.parent} is incomplete ({e}); prepare it again") from e
    if len(mask) != len(tokens) or int(offsets[-1]) != len(tokens):
        raise UserError(f"{key}: {path.parent} has mismatched files; prepare it again")
    return Examples(tokens, mask, offsets), desc


def concat_examples(parts: list[Examples]) -> Examples:
    """The examples of several prepared files as one `Examples`, in order."""
    sizes = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
    offsets = [parts[0].offsets[:1]] + [
        p.offsets[1:] + s for p, s in zip(parts, sizes, strict=True)
    ]
    return Examples(
        np.concatenate([np.asarray(p.tokens) for p in parts]),
        np.concatenate([np.asarray(p.mask) for p in parts]),
        np.concatenate([np.asarray(o, dtype=np.int64) for o in offsets]),
    )


# --------------------------------------------------------------------------------------------
# Writing (prepare-data)


def _write_examples(stage: Path, stem: str, examples: Examples, dtype: str) -> dict[str, int]:
    (stage / f"{stem}.bin").write_bytes(np.asarray(examples.tokens).astype(dtype).tobytes())
    (stage / f"{stem}.mask.bin").write_bytes(np.asarray(examples.mask).astype(np.uint8).tobytes())
    np.save(stage / f"{stem}.offsets.npy", np.asarray(examples.offsets, dtype=np.int64))
    return {
        "num_tokens": len(examples.tokens),
        "num_examples": examples.num_examples,
        "num_trained_tokens": int(np.count_nonzero(examples.mask)),
    }


def prepare_sft_data(cfg: DataConfig, out: Path, *, val_fraction: float = 0.0) -> dict[str, Any]:
    """Tokenize the fine-tuning examples of `cfg` (source chat, instruct or hf_dataset; paths,
    tokenizer, fields, template, chat_turns) into OUT (see the module doc): train.* and, with
    `val_fraction`, val.* holding the last examples. Fitting to a sequence length and packing
    happen at training time, so one folder serves any train.seq_len.

    Returns:
        The description written to OUT/data.json.

    Raises:
        UserError: a bad input (as for training), a non-empty OUT, a fraction leaving no examples.
    """
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction must be in [0, 1) (got {val_fraction})")
    if not cfg.paths:
        raise UserError("no inputs; pass example files or a saved dataset folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder (nothing is overwritten)")
    examples, tok = tokenize_examples(cfg.paths, cfg, key="input")
    n = examples.num_examples
    num_val = round(n * val_fraction)
    if val_fraction and not 0 < num_val < n:
        raise UserError(
            f"--val-fraction {val_fraction} of {n} examples leaves {num_val} for validation and "
            f"{n - num_val} for training; both need at least one"
        )
    dtype = token_dtype_for(tok.vocab_size)
    with staged_folder(out) as stage:
        files = {
            "train.bin": _write_examples(stage, "train", examples.take(range(n - num_val)), dtype)
        }
        if num_val:
            files["val.bin"] = _write_examples(
                stage, "val", examples.take(range(n - num_val, n)), dtype
            )
        description = {
            "format": SFT_FORMAT,
            "version": 1,
            "dtype": dtype,
            "vocab_size": tok.vocab_size,
            "tokenizer": tok.name,
            "eos_id": tok.eos_id,
            "source": cfg.source.value,
            "num_examples": n,
            "num_tokens": len(examples.tokens),
            "files": files,
            "sources": list(cfg.paths),
            "chat_turns": cfg.chat_turns.value,
            "prompt_field": cfg.prompt_field,
            "response_field": cfg.response_field,
            "template": cfg.template,
        }
        (stage / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
    return description


def prepare_sft_examples(
    inputs: list[Path],
    out: Path,
    *,
    source: str,
    tokenizer: str,
    val_fraction: float,
    chat_turns: str = "all",
    prompt_field: str = "prompt",
    response_field: str = "response",
    template: str | None = None,
    roles: list[str] | None = None,
    max_line_bytes: int = 1 << 20,
    eos_token: str | None = None,
) -> dict[str, Any]:
    """`prepare_sft_data` from command-line values (checked here, one line each); `roles` are
    `--role NAME=ROLE` values (data.roles)."""

    def choice(enum_type, value: str, flag: str):
        try:
            return enum_type(value)
        except ValueError:
            names = ", ".join(e.value for e in enum_type)
            raise UserError(f"{flag} {value!r} is not one of: {names}") from None

    kind = choice(DataSource, source, "--source")
    if kind not in SFT_SOURCES:
        raise UserError(f"--source {source}: prepare-data takes text, chat, instruct or hf_dataset")
    if max_line_bytes <= 0:
        raise UserError(f"--max-line-bytes must be > 0 (got {max_line_bytes})")
    role_map = {}
    for spec in roles or []:
        name, eq, to = spec.partition("=")
        if not (eq and name and (to in CHAT_ROLES or to == name)):
            raise UserError(
                f"--role {spec!r} is not NAME=ROLE with ROLE one of {', '.join(CHAT_ROLES)} "
                "(or NAME itself, to pass the role to the chat template as it is)"
            )
        role_map[name] = to
    cfg = DataConfig(
        source=kind, paths=[str(p.resolve()) for p in inputs], tokenizer=tokenizer,
        chat_turns=choice(ChatTurns, chat_turns, "--chat-turns"), prompt_field=prompt_field,
        response_field=response_field, roles=role_map, max_line_bytes=max_line_bytes,
        eos_token=eos_token,
    )  # fmt: skip
    if template is not None:
        cfg.template = template
    if kind is DataSource.instruct and "{prompt}" not in cfg.template:
        raise UserError(
            f"--template {cfg.template!r} has no {{prompt}}; put it where the prompt goes"
        )
    return prepare_sft_data(cfg, out, val_fraction=val_fraction)
