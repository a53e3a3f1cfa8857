"""Text files → token ids: local tokenizers, reading .txt/.jsonl, and `fsdprun prepare-data`.

    fsdprun prepare-data corpus/*.txt --out data/corpus --val-fraction 0.05
    fsdprun prepare-data docs.jsonl --out data/docs --tokenizer path/to/tokenizer.json

Documents are tokenized one after another, each followed by the tokenizer's end-of-text token,
into one stream: data.eos_token (--eos-token) names it, else the tokenizer's folder or a known
spelling gives it (`find_eos_id`), else the data is refused (`none`: no separator, on purpose).
The byte tokenizer is built in (no download); a HuggingFace `tokenizer.json` is read through the
optional `tokenizers` package. The tokens are those of `encode` on each
whole document: a large .txt file is read in pieces only where cutting it cannot change them.

Never imports torch (tokenizers where it tokenizes).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fsdprun.config.model_facts import config_json
from fsdprun.data.files import DESCRIPTION, check_input_file, token_dtype_for
from fsdprun.data.lazy_numpy import np
from fsdprun.errors import UserError
from fsdprun.staging import staged_folder

TEXT_SUFFIXES = (".txt", ".jsonl")
# End-of-text tokens of common HuggingFace tokenizers, tried in this order.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
# data.eos_token (--eos-token) for "no end-of-text between documents", on purpose.
NO_EOS = "none"
# .txt files are read this many characters at a time, and tokenized in pieces cut where the
# tokenizer allows (`Cuts`): pieces of about this size, or the whole file.
TXT_CHUNK_CHARS = 1 << 20


# Where a text may be cut into pieces that, tokenized one after another, give exactly the tokens
# of the whole: "anywhere"; "newline": just after a "\n" with a non-space character on each side;
# "space": just before a " "; None: nowhere (the text is tokenized whole).
Cuts = Literal["anywhere", "newline", "space"] | None


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 ends a document."""

    name: str = "byte"
    vocab_size: int = 257
    eos_id: int | None = 256
    cuts: Cuts = "anywhere"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)


class HFTokenizer:
    """A HuggingFace `tokenizer.json` through the `tokenizers` library.

    Args:
        path: the tokenizer.json.
        eos_token: data.eos_token: None = found (`find_eos_id`), `none` = no end-of-text, else
            the spelling of a token of the vocabulary.
        require_eos: refuse a tokenizer whose end-of-text cannot be found (for data about to be
            tokenized); False gives eos_id None instead (reading what an older run used).

    Raises:
        UserError: no tokenizers package, an unreadable file, a named token that is not in the
            vocabulary, or (require_eos) no end-of-text found and none named.
    """

    def __init__(self, path: Path, eos_token: str | None = None, *, require_eos: bool = True):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(
                f"data.tokenizer {path} needs the `tokenizers` package: pip install "
                "'fsdprun[text]' (or pip install tokenizers), or use data.tokenizer=byte"
            ) from None
        if not path.is_file():
            raise UserError(
                f"tokenizer {path} does not exist (a tokenizer.json, a folder holding one, or "
                "`byte`)"
            )
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"tokenizer {path} cannot be read: {first}") from e
        # Truncation and padding shape batches of model inputs; saved in a tokenizer.json they
        # would cut every document (or every piece of a .txt) short, or pad it with pad ids.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.cuts = _cuts_of(json.loads(self._tok.to_str()))
        self.name = str(path)
        # The ids the model must embed: one past the largest (a vocabulary may have gaps).
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if eos_token == NO_EOS:
            self.eos_id = None
        elif eos_token is not None:
            self.eos_id = self._tok.token_to_id(eos_token)
            if self.eos_id is None:
                raise UserError(
                    f"data.eos_token {eos_token!r} (--eos-token) is not a token of {path}; name "
                    f"one of its tokens, or {NO_EOS} to join documents with no separator"
                )
        else:
            self.eos_id = find_eos_id(path, self._tok.token_to_id, self.vocab_size)
            if self.eos_id is None and require_eos:
                raise UserError(
                    f"data.tokenizer {path}: no end-of-text token found (none named by "
                    "tokenizer_config.json, config.json or generation_config.json beside it, and "
                    f"none of {', '.join(EOS_CANDIDATES)} in its vocabulary), so documents would "
                    "run together; name it with data.eos_token (prepare-data --eos-token), or "
                    f"set it to {NO_EOS} for no separator"
                )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)


def _json_beside(path: Path, name: str) -> dict[str, Any]:
    try:
        data = json.loads((path.parent / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent or unreadable: it names no end-of-text
        return {}
    return data if isinstance(data, dict) else {}


def find_eos_id(path: Path, token_to_id: Any, vocab_size: int) -> int | None:
    """The end-of-text id of the tokenizer.json `path`: the token its folder's
    tokenizer_config.json names (`eos_token`), else the id config.json or generation_config.json
    gives (`eos_token_id`; the first of a list), else the first of EOS_CANDIDATES in the
    vocabulary; None when none is found."""
    named = _json_beside(path, "tokenizer_config.json").get("eos_token")
    if isinstance(named, dict):  # a saved AddedToken
        named = named.get("content")
    if isinstance(named, str) and (found := token_to_id(named)) is not None:
        return found
    # The model's config.json (read where every config.json is) before generation_config.json.
    configs = (config_json(path.parent) or {}, _json_beside(path, "generation_config.json"))
    for config in configs:
        ids = config.get("eos_token_id")
        first = ids[0] if isinstance(ids, list) and ids else ids
        if isinstance(first, int) and not isinstance(first, bool) and 0 <= first < vocab_size:
            return first
    ids = (token_to_id(t) for t in EOS_CANDIDATES)
    return next((i for i in ids if i is not None), None)


# Pre-tokenizer regexes (Split, or ByteLevel's built-in GPT-2 one) after which "newline" cuts are
# exact: no alternative matches a "\n" followed by a non-space character, there is no
# look-behind, and the one look-ahead, `\s+(?!\S)`, gives a lone "\n" (a non-space character
# before it) the same piece at the end of a text as before a non-space character.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)  # Llama 3, Mistral's Tekken; Qwen 2 splits digits one by one:
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Normalizers that change each character (or combining sequence) alone, so a cut before a
# character that does not combine backwards changes nothing; the first ones also never turn a
# character into a space or back (which the regexes above depend on).
SPACE_KEEPING_NORMALIZERS = {"NFC", "NFD", "Lowercase"}
LOCAL_NORMALIZERS = SPACE_KEEPING_NORMALIZERS | {"NFKC", "NFKD", "StripAccents", "BertNormalizer"}
# Pre-tokenizers that split each piece an earlier one made on its own, whatever its position.
PER_PIECE_PRE_TOKENIZERS = {
    "ByteLevel", "CharDelimiterSplit", "Digits", "Punctuation", "Split", "Whitespace",
    "WhitespaceSplit",
}  # fmt: skip


def _flat(node: dict | None, key: str) -> list[dict]:
    if node is None:
        return []
    if node["type"] == "Sequence":
        return [leaf for child in node[key] for leaf in _flat(child, key)]
    return [node]


def _cuts_of(spec: dict[str, Any]) -> Cuts:
    """Where a text may be cut for the tokenizer `spec` (a tokenizer.json): the normalizer and
    the first pre-tokenizer decide; models (BPE, WordPiece, Unigram, WordLevel) never merge
    across the pieces of the pre-tokenizer. Anything not known to be exact gives None."""
    for added in spec.get("added_tokens") or []:
        # An added token found in the text can strip the whitespace next to it, or hold it.
        if added.get("lstrip") or added.get("rstrip") or any(c.isspace() for c in added["content"]):
            return None
    normalizers = {n["type"] for n in _flat(spec.get("normalizer"), "normalizers")}
    first, *rest = _flat(spec.get("pre_tokenizer"), "pretokenizers") or [None]
    if first is None or any(p["type"] not in PER_PIECE_PRE_TOKENIZERS for p in rest):
        return None
    kind = first["type"]
    if kind == "Metaspace" and first.get("split", True) and normalizers <= LOCAL_NORMALIZERS:
        # Every " " (as "▁") starts a word, and a piece that starts with one gets no extra "▁"
        # from prepend_scheme: cut before a space.
        return "space"
    if kind in ("Whitespace", "WhitespaceSplit", "BertPreTokenizer"):
        return "newline" if normalizers <= LOCAL_NORMALIZERS else None
    if kind == "ByteLevel":  # GPT-2's regex; a prefix space would start each piece with one
        known = first.get("use_regex", True) and not first.get("add_prefix_space")
    elif kind == "Split":
        pattern = (first.get("pattern") or {}).get("Regex")
        known = pattern in (GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT) and not first.get("invert")
        known = known and first.get("behavior") == "Isolated"
    else:
        return None
    return "newline" if known and normalizers <= SPACE_KEEPING_NORMALIZERS else None


def build_tokenizer(
    spec: str, eos_token: str | None = None, *, require_eos: bool = True
) -> ByteTokenizer | HFTokenizer:
    """`byte`, the path of a tokenizer.json or of a HuggingFace folder holding one (a model's,
    a Hub id's snapshot), with the end-of-text data.eos_token names (see `HFTokenizer`): what
    data.tokenizer names for text and instruct data alike."""
    if spec != "byte":
        path = Path(spec)
        path = path / "tokenizer.json" if path.is_dir() else path
        return HFTokenizer(path, eos_token, require_eos=require_eos)
    if eos_token is None:
        return ByteTokenizer()
    if eos_token == NO_EOS:
        return ByteTokenizer(eos_id=None)
    raise UserError(
        f"data.eos_token {eos_token!r} (--eos-token): the byte tokenizer's end-of-text is id 256 "
        f"(leave data.eos_token null), or {NO_EOS} for no separator"
    )


def check_text_file(path: Path, *, key: str) -> None:
    check_input_file(
        path, key=key, suffixes=TEXT_SUFFIXES,
        wrong_kind="is not a text file (.txt or .jsonl); token files need data.source=tokens",
    )  # fmt: skip


def iter_documents(path: Path, text_field: str, *, cuts: Cuts) -> Iterator[Iterable[str]]:
    """The documents of a file, each as pieces of text (a .txt file is one document, read in
    pieces cut where `cuts` allows, so a large file is held at once only where nowhere is; a
    .jsonl line is one)."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise UserError(f"{path} line {n}: not JSON ({e})") from e
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    fields = sorted(record) if isinstance(record, dict) else []
                    raise UserError(
                        f"{path} line {n}: no text field '{text_field}' (fields: {fields}); "
                        "set data.text_field (--text-field)"
                    )
                yield [record[text_field]]
        return
    yield _txt_pieces(path, cuts)


def _last_cut(text: str, cuts: Cuts) -> int:
    """The last place in `text` where it may be cut (0: none)."""
    if cuts == "anywhere":
        return len(text)
    if cuts == "space":
        return max(text.rfind(" "), 0)
    i = len(text) - 1
    while (i := text.rfind("\n", 1, i)) > 0:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i + 1
    return 0


def _txt_pieces(path: Path, cuts: Cuts) -> Iterator[str]:
    # newline="": the text verbatim (a byte-tokenized .txt has exactly its size in tokens).
    with path.open(encoding="utf-8", newline="") as f:
        if cuts is None:
            yield f.read()
            return
        held: list[str] = []  # read, not given out yet: no place to cut it was found
        tail = ""  # the last characters of `held`: a cut near the next chunk's start needs them
        while chunk := f.read(TXT_CHUNK_CHARS):
            window = tail + chunk
            cut = _last_cut(window, cuts)
            if cut:
                text = "".join(held) + chunk
                cut += len(text) - len(window)
                yield text[:cut]
                held, tail = [text[cut:]], text[cut:][-2:]
            else:
                held.append(chunk)
                tail = window[-2:]
        if rest := "".join(held):
            yield rest


def tokenize_files(
    paths: list[Path], tokenizer: ByteTokenizer | HFTokenizer, text_field: str
) -> Iterator[np.ndarray]:
    """Token ids of every document of `paths`, in order, each followed by end-of-text."""
    eos = (
        np.array([tokenizer.eos_id], dtype=np.uint32)
        if tokenizer.eos_id is not None
        else np.zeros(0, dtype=np.uint32)
    )
    for path in paths:
        try:
            for pieces in iter_documents(path, text_field, cuts=tokenizer.cuts):
                for piece in pieces:
                    yield tokenizer.encode(piece)
                yield eos
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def tokenize_to_array(
    paths: list[Path], tokenizer: ByteTokenizer | HFTokenizer, text_field: str
) -> np.ndarray:
    parts = list(tokenize_files(paths, tokenizer, text_field))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def prepare_data(
    inputs: list[Path],
    out: Path,
    *,
    tokenizer: str = "byte",
    val_fraction: float = 0.0,
    text_field: str = "text",
    eos_token: str | None = None,
) -> dict[str, Any]:
    """Tokenize text files into OUT/train.bin (and OUT/val.bin: the last `val_fraction` of the
    tokens) plus OUT/data.json. Streams: memory stays small at any corpus size.

    Returns:
        The description written to OUT/data.json.

    Raises:
        UserError: a missing or unreadable input, a non-empty OUT, a fraction that leaves no
            training or no validation tokens (then nothing is written).
    """
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction must be in [0, 1) (got {val_fraction})")
    if not inputs:
        raise UserError("no input files; pass .txt or .jsonl files")
    for path in inputs:
        check_text_file(path, key="input")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder (nothing is overwritten)")
    tok = build_tokenizer(tokenizer, eos_token)
    dtype = token_dtype_for(tok.vocab_size)
    # Written into a folder beside OUT that becomes OUT at the end: a run that fails halfway (a
    # bad input line, a full disk) leaves nothing, and the retry is not refused.
    with staged_folder(out) as stage:
        train = stage / "train.bin"
        total = 0
        with train.open("wb") as f:
            for ids in tokenize_files(inputs, tok, text_field):
                f.write(ids.astype(dtype).tobytes())
                total += len(ids)
        if total == 0:
            raise UserError("the inputs hold no text")
        files = {"train.bin": {"num_tokens": total}}
        num_val = round(total * val_fraction)
        if val_fraction and not 0 < num_val < total:
            raise UserError(
                f"--val-fraction {val_fraction} of {total} tokens leaves {num_val} for "
                f"validation and {total - num_val} for training; both need at least one "
                "(change the fraction, or add text)"
            )
        if num_val:
            # The tail of the stream becomes val.bin; train.bin is then cut short.
            itemsize = np.dtype(dtype).itemsize
            tail = np.memmap(train, dtype=dtype, mode="r", offset=(total - num_val) * itemsize)
            (stage / "val.bin").write_bytes(tail.tobytes())
            del tail
            os.truncate(train, (total - num_val) * itemsize)
            files = {
                "train.bin": {"num_tokens": total - num_val},
                "val.bin": {"num_tokens": num_val},
            }
        description = {
            "format": "fsdprun-tokens",
            "version": 1,
            "dtype": dtype,
            "vocab_size": tok.vocab_size,
            "tokenizer": tok.name,
            "eos_id": tok.eos_id,
            "num_tokens": total,
            "files": files,
            "sources": [str(p) for p in inputs],
            "text_field": text_field,
        }
        (stage / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
    return description
