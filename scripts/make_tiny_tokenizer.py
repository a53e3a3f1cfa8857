"""Write the byte tokenizer as a HuggingFace tokenizer into recipes/data/tiny-llama-hf.

    .venv/bin/python scripts/make_tiny_tokenizer.py [FOLDER]

The shipped tiny model has 257 tokens: UTF-8 bytes 0..255 and 256 = "<|endoftext|>", the
built-in `byte` tokenizer of fsdprun. This writes the same tokenizer as tokenizer.json (a
byte-level BPE with no merges whose vocabulary maps the byte-level symbol of byte b to id b) and a
tokenizer_config.json with eos_token and a small chat template, so transformers'
`AutoTokenizer` and `apply_chat_template` work on the folder without the hub. The only difference
from the built-in tokenizer: the literal text "<|endoftext|>" becomes id 256 (a special token),
which is what the chat template relies on to end assistant turns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

EOS = "<|endoftext|>"
# Markers are plain text (bytes); only the end of an assistant turn is a special token, so the
# trained span of a turn is its content plus end-of-text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}<|endoftext|>"
    "{% else %}{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which ByteLevel pre-tokenization applies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build() -> Tokenizer:
    vocab = {char: b for b, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No merges: every byte stays one token, so splitting by the regex changes nothing.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    assert tok.token_to_id(EOS) == 256
    return tok


def check(tok: Tokenizer) -> None:
    for text in ("hello, world\n", "naïve — 日本語 🙂\t\r\n", "  two  spaces "):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == list(text.encode("utf-8")), text
        assert tok.decode(ids) == text


def main(folder: Path) -> None:
    tok = build()
    check(tok)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {folder}/tokenizer.json and tokenizer_config.json")


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else root / "recipes/data/tiny-llama-hf")
