"""Fine-tuning examples → (token ids, loss mask): reading chat, instruct and local HF data.

An example is one conversation (`data.source: chat`, a `messages` list of role/content) or one
prompt/response pair (`data.source: instruct`); `hf_dataset` rows are either shape. Each becomes
token ids and a boolean mask, True on the tokens that train (are targets):

- chat: the conversation rendered by the tokenizer's own chat template (transformers'
  `apply_chat_template`, local files only). Assistant turn i trains on the tokens between the
  rendering of messages[:i] with the generation prompt and the rendering of messages[:i+1]:
  the turn's content and whatever the template closes it with (end-of-text). An opening
  assistant turn (i = 0) has no earlier messages to render: what the template puts before its
  content (the role header) is context just the same. This needs each rendering to be a prefix
  of the next; a template that breaks it is refused.
- instruct: data.template with {prompt} replaced (context), then the response and end-of-text
  (trained).

Records are read from .jsonl (one JSON object a line) and .parquet files (pyarrow), or through
the `datasets` library from a `save_to_disk` folder or local json/jsonl/parquet/arrow files.
Nothing is ever downloaded. An example larger than data.max_line_bytes (a .jsonl line, or the
text of a row) is refused before it is tokenized; a .jsonl line is read no further than that.
Chat roles are system, user and assistant, or mapped onto those by data.roles; any other is
refused (a template renders any role somehow, and it would silently be context).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdprun.config import CHAT_ROLES, ChatTurns, DataConfig, DataSource
from fsdprun.data.lazy_numpy import np
from fsdprun.data.text import ByteTokenizer, HFTokenizer, build_tokenizer
from fsdprun.errors import UserError

SFT_SOURCES = (DataSource.chat, DataSource.instruct, DataSource.hf_dataset)
EXAMPLE_SUFFIXES = (".jsonl", ".parquet")
HF_FILE_KINDS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
# Stands for the content of a conversation's opening assistant message while its header is found
# (`ChatTokenizer.opening_context`): letters only, so a template that trims or escapes content
# leaves it as it is.
OPENING_MARKER = "FSDPRUNOPENINGASSISTANTCONTENT"


class ChatTokenizer:
    """A HuggingFace tokenizer folder with a chat template, through transformers (local only)."""

    def __init__(self, folder: Path):
        if folder.is_file():  # a tokenizer.json: its folder holds tokenizer_config.json
            folder = folder.parent
        if not (folder / "tokenizer_config.json").is_file():
            raise UserError(
                f"data.tokenizer: {folder} has no tokenizer_config.json; chat data needs a "
                "HuggingFace tokenizer folder with a chat_template"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise UserError(
                "chat data renders conversations with transformers: pip install 'fsdprun[hf]'"
            ) from None
        try:
            self._tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # transformers raises many kinds for a broken folder
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"data.tokenizer: {folder} cannot be loaded: {first}") from e
        if not getattr(self._tok, "chat_template", None):
            raise UserError(
                f"data.tokenizer: {folder}/tokenizer_config.json has no chat_template; add one, or "
                "use data.source=instruct with data.template"
            )
        self.folder, self.name = folder, str(folder)
        self.vocab_size = len(self._tok)
        self.eos_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def render(self, messages: list[dict], *, generation_prompt: bool, where: str) -> list[int]:
        try:
            text = self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # a template may raise (e.g. "roles must alternate")
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"{where}: the chat template of {self.folder} refused it: {first}"
            ) from e
        return self.encode(text)

    def opening_context(self, first: dict, *, where: str) -> list[int]:
        """The tokens a conversation that opens with assistant message `first` renders before
        that message's content: its role header (and whatever the template puts first, such as a
        default system prompt). transformers renders no empty conversation, so there is no
        "nothing, then the generation prompt" to compare with, as for later turns: the content is
        replaced by a marker and the text before the marker is the context."""
        marked = {**first, "content": OPENING_MARKER}
        try:
            text = self._tok.apply_chat_template(
                [marked], tokenize=False, add_generation_prompt=False
            )
        except Exception as e:  # as in render
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"{where}: the chat template of {self.folder} refused it: {first_line}"
            ) from e
        if text.count(OPENING_MARKER) != 1:
            raise UserError(
                f"{where}: the chat template of {self.folder} does not render an opening "
                "assistant message's content once, as given, so its header cannot be told from "
                "its content; start the conversation with a user or system message"
            )
        return self.encode(text[: text.index(OPENING_MARKER)])


def build_sft_tokenizer(
    cfg: DataConfig, *, chat: bool
) -> ChatTokenizer | ByteTokenizer | HFTokenizer:
    """The tokenizer of fine-tuning data: a chat template folder for chat rows; for instruct
    rows the tokenizer of text data (`build_tokenizer`)."""
    if chat:
        if cfg.tokenizer == "byte":
            raise UserError(
                "data.tokenizer is byte, which has no chat template; set data.tokenizer to a "
                "HuggingFace folder with tokenizer_config.json (e.g. model.hf_path)"
            )
        return ChatTokenizer(Path(cfg.tokenizer))
    return build_tokenizer(cfg.tokenizer, cfg.eos_token)


# --------------------------------------------------------------------------------------------
# Records


def _check_local(path: Path, key: str) -> None:
    if not path.exists():
        raise UserError(
            f"{key}: {path} is not a local file or folder; fsdprun never downloads data: save "
            "a hub dataset once with datasets' load_dataset(NAME).save_to_disk(FOLDER) and list "
            "the folder"
        )


def iter_records(
    path: Path, *, key: str, source: DataSource, max_line_bytes: int = 1 << 20
) -> Iterator[tuple[str, Any]]:
    """(where, record) for every example of one file or dataset folder; `where` names the file
    and line (or row) for messages. A .jsonl line longer than `max_line_bytes` is refused
    having read no more of it than that."""
    _check_local(path, key)
    if source is DataSource.hf_dataset:
        yield from _hf_records(path, key)
        return
    if not path.is_file() or path.suffix not in EXAMPLE_SUFFIXES:
        raise UserError(
            f"{key}: {path} is not a .jsonl or .parquet file of {source.value} examples "
            "(a saved dataset folder needs data.source=hf_dataset)"
        )
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(
                f"{key}: {path} needs pyarrow to read parquet: pip install 'fsdprun[datasets]'"
            ) from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors for a damaged file
            raise UserError(f"{key}: {path} is not a readable parquet file ({e})") from e
        for n, row in enumerate(rows):
            yield f"{path} row {n}", row
        return
    yield from _jsonl_records(path, max_line_bytes)


def _jsonl_records(path: Path, max_line_bytes: int) -> Iterator[tuple[str, Any]]:
    # Lines are read with a bound: one huge line (a 20 MB conversation) would otherwise be read
    # whole, then rendered and tokenized in native code that may abort the interpreter.
    with path.open("rb") as f:
        n = 0
        while raw := f.readline(max_line_bytes + 1):
            n += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise UserError(
                    f"{path} line {n}: longer than data.max_line_bytes = {max_line_bytes:,} "
                    "bytes; remove the example, or raise data.max_line_bytes (prepare-data "
                    "--max-line-bytes) if it is meant to be that long"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{path} line {n}: not UTF-8 text ({e.reason} at byte {e.start} of the line)"
                ) from e
            if not line.strip():
                continue
            try:
                yield f"{path} line {n}", json.loads(line)
            except ValueError as e:
                raise UserError(f"{path} line {n}: not JSON ({e})") from e


def _hf_records(path: Path, key: str) -> Iterator[tuple[str, Any]]:
    # Offline before the import: the library reads these at import time, and a local folder or
    # file must never turn into a hub request.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{key}: data.source=hf_dataset needs the datasets library: pip install "
            "'fsdprun[datasets]'"
        ) from None
    # Its progress bars ("Generating train split") would land on the terminal before an error
    # line, and reading local files takes no time worth showing.
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise UserError(
                        f"{key}: {path} holds the splits {sorted(ds)} and no `train`; list the "
                        "folder of one split (DatasetDict[split].save_to_disk)"
                    )
                ds = ds["train"]
        elif path.suffix in HF_FILE_KINDS:
            ds = datasets.load_dataset(
                HF_FILE_KINDS[path.suffix], data_files=str(path), split="train"
            )
        else:
            raise UserError(
                f"{key}: {path} is not a saved dataset folder or a .json/.jsonl/.parquet/.arrow "
                "file"
            )
    except UserError:
        raise
    except Exception as e:  # the library's errors for a folder it did not write
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{key}: {path} cannot be read by datasets: {first}") from e
    for n, row in enumerate(ds):
        yield f"{path} row {n}", row


# --------------------------------------------------------------------------------------------
# Tokenizing one example


def is_chat_record(record: Any) -> bool:
    return isinstance(record, dict) and "messages" in record


def _check_text_size(texts: list[str], max_bytes: int, where: str) -> None:
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > max_bytes:
        raise UserError(
            f"{where}: {size:,} bytes of text, more than data.max_line_bytes = {max_bytes:,}; "
            "remove the example, or raise data.max_line_bytes (prepare-data --max-line-bytes) "
            "if it is meant to be that long"
        )


def tokenize_chat(
    tok: ChatTokenizer, record: Any, *, turns: ChatTurns, where: str,
    roles: dict[str, str] | None = None, max_bytes: int = 1 << 20,
) -> tuple[list[int], np.ndarray]:  # fmt: skip
    """Token ids and trained-token mask of one conversation; `roles` maps roles beyond
    CHAT_ROLES onto the role the template is given (data.roles), others are refused."""
    roles = roles or {}
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: no `messages` list (a chat example is {{"messages": [...]}})')
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise UserError(f'{where}: message {i} is not {{"role": str, "content": str}}')
        if m["role"] not in CHAT_ROLES and m["role"] not in roles:
            # A template renders any role somehow (the tiny one as <|robot|>), and a turn that is
            # not `assistant` never trains: a typo or another dataset's role names would train
            # silently wrong.
            raise UserError(
                f"{where}: message {i} has role {m['role']!r}, not one of "
                f"{', '.join(CHAT_ROLES)}; map it with data.roles (prepare-data --role), e.g. "
                f"data.roles={{{m['role']}: assistant}}, or fix the file"
            )
    _check_text_size([m["content"] for m in messages], max_bytes, where)
    messages = [{**m, "role": roles.get(m["role"], m["role"])} for m in messages]
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        raise UserError(f"{where}: no assistant turn, so nothing would train; remove the example")
    full = tok.render(messages, generation_prompt=False, where=where)
    mask = np.zeros(len(full), dtype=bool)
    for i in assistants if turns is ChatTurns.all else assistants[-1:]:
        span = _turn_span(tok, messages, i, full, where=where)
        if span is None:
            raise UserError(
                f"{where}: the chat template of {tok.folder} does not render a conversation as "
                f"its first messages plus the rest (at message {i}), so its assistant turns "
                f"cannot be masked; {_unmaskable_hint(tok, messages, i, turns, where=where)}"
            )
        mask[span[0] : span[1]] = True
    return full, mask


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _turn_span(
    tok: ChatTokenizer, messages: list[dict], i: int, full: list[int], *, where: str
) -> tuple[int, int] | None:
    """Where assistant turn i lies in `full` (the whole conversation's tokens), or None when the
    template's renderings of the first messages are no prefixes of it."""
    before = (
        tok.render(messages[:i], generation_prompt=True, where=where)
        if i
        else tok.opening_context(messages[0], where=where)
    )
    upto = tok.render(messages[: i + 1], generation_prompt=False, where=where)
    # A template may close a conversation that ends there (Phi-3 appends end-of-text after the
    # last message, not after each): the turn ends where rendering its messages with and without
    # a generation prompt part.
    grown = tok.render(messages[: i + 1], generation_prompt=True, where=where)
    upto = upto[: _common_prefix(upto, grown)]
    if upto[: len(before)] != before or full[: len(upto)] != upto or len(upto) <= len(before):
        return None
    return len(before), len(upto)


def _unmaskable_hint(
    tok: ChatTokenizer, messages: list[dict], i: int, turns: ChatTurns, *, where: str
) -> str:
    """The fix for a conversation whose turn i cannot be masked, as the template allows."""

    def maskable(msgs: list[dict], turn: int) -> bool:
        full = tok.render(msgs, generation_prompt=False, where=where)
        return _turn_span(tok, msgs, turn, full, where=where) is not None

    if messages[0]["role"] == "system" and i > 0 and maskable(messages[1:], i - 1):
        # Mistral's template renders the system message into the last user message only.
        return (
            "it places the system message by what follows it: remove the system message, or "
            "put its text into the first user message"
        )
    last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
    if turns is ChatTurns.all and i != last and maskable(messages, last):
        # Qwen3's template drops the reasoning of turns before the last user message.
        return (
            "it renders earlier turns otherwise once later ones follow: train the last "
            "assistant turn only (data.chat_turns=last), or use a template whose renderings "
            "extend one another"
        )
    return "use a template whose renderings extend one another"


def tokenize_instruct(
    tok: ByteTokenizer | HFTokenizer, record: Any, cfg: DataConfig, *, where: str
) -> tuple[list[int], np.ndarray]:
    """Token ids and trained-token mask of one prompt/response pair: the template with the prompt
    (context), then the response and end-of-text (trained)."""
    for field in (cfg.prompt_field, cfg.response_field):
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            fields = sorted(record) if isinstance(record, dict) else []
            key = "data.prompt_field" if field == cfg.prompt_field else "data.response_field"
            raise UserError(f"{where}: no text field '{field}' (fields: {fields}); set {key}")
    _check_text_size(
        [record[cfg.prompt_field], record[cfg.response_field]], cfg.max_line_bytes, where
    )
    prompt = [
        int(t) for t in tok.encode(cfg.template.replace("{prompt}", record[cfg.prompt_field]))
    ]
    response = [int(t) for t in tok.encode(record[cfg.response_field])]
    if tok.eos_id is not None:
        response.append(tok.eos_id)
    mask = np.zeros(len(prompt) + len(response), dtype=bool)
    mask[len(prompt) :] = True
    return prompt + response, mask


@dataclass
class Examples:
    """Tokenized examples, flat: example k is tokens[offsets[k]:offsets[k+1]] (and its mask)."""

    tokens: np.ndarray  # uint32 in memory; uint16/uint32 memory map when prepared
    mask: np.ndarray  # bool or uint8: 1 = the token is a target
    offsets: np.ndarray  # int64, num_examples + 1

    @property
    def num_examples(self) -> int:
        return len(self.offsets) - 1

    def take(self, ids: range) -> Examples:
        """Examples `ids` (consecutive) as their own `Examples`, sharing the arrays."""
        lo, hi = int(self.offsets[ids.start]), int(self.offsets[ids.stop])
        return Examples(
            self.tokens[lo:hi], self.mask[lo:hi], self.offsets[ids.start : ids.stop + 1] - lo
        )


def tokenize_examples(paths: list[str], cfg: DataConfig, *, key: str) -> tuple[Examples, Any]:
    """Every example of `paths`, in order, tokenized; and the tokenizer used.

    Raises:
        UserError: a missing file or hub name, a bad line, a missing field, no messages, no
            assistant turn, a template that cannot be masked.
    """
    tok = None
    roles = dict(cfg.roles)
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for p in paths:
        records = iter_records(
            Path(p), key=key, source=cfg.source, max_line_bytes=cfg.max_line_bytes
        )
        for where, record in records:
            chat = cfg.source is DataSource.chat or (
                cfg.source is DataSource.hf_dataset and is_chat_record(record)
            )
            if tok is None:  # the first record says which kind a hf_dataset holds
                tok = build_sft_tokenizer(cfg, chat=chat)
            if chat:
                if not isinstance(tok, ChatTokenizer):
                    raise UserError(f"{where}: a chat example among instruct examples")
                t, m = tokenize_chat(
                    tok, record, turns=cfg.chat_turns, where=where, roles=roles,
                    max_bytes=cfg.max_line_bytes,
                )  # fmt: skip
            else:
                if isinstance(tok, ChatTokenizer) and cfg.source is DataSource.hf_dataset:
                    raise UserError(f"{where}: no `messages` (an instruct example among chat ones)")
                t, m = tokenize_instruct(tok, record, cfg, where=where)
            ids.append(np.asarray(t, dtype=np.uint32))
            masks.append(m)
    if tok is None:
        raise UserError(f"{key}: no examples in {', '.join(paths)}")
    lengths = np.array([len(t) for t in ids], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
    return Examples(np.concatenate(ids), np.concatenate(masks), offsets), tok
