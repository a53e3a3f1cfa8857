"""Write the small demo chat file recipes/data/chat.jsonl (deterministic: same bytes every run).

    python scripts/make_chat_data.py [OUT]

120 short conversations in the `messages` layout of chat fine-tuning data (role/content): simple
tasks a tiny byte-level model can pick up (adding small numbers, reversing or upper-casing a
word, counting letters), some with a system message, some with two or three exchanges.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = [
    "apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "candle", "forest", "rocket",
    "violet", "garden", "silver", "planet", "window", "marble", "dragon", "castle", "ocean",
    "pepper",
]  # fmt: skip
SYSTEM = "You are a concise assistant."


def exchange(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(50), rng.randrange(50)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    word = rng.choice(WORDS)
    if kind == 1:
        return f"Reverse the word '{word}'.", f"'{word}' reversed is '{word[::-1]}'."
    if kind == 2:
        return f"Write '{word}' in capitals.", word.upper()
    letter = rng.choice(word)
    return (
        f"How many times does '{letter}' appear in '{word}'?",
        f"'{letter}' appears {word.count(letter)} time{'s' if word.count(letter) > 1 else ''}.",
    )


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    for _ in range(rng.choice((1, 1, 2, 3))):
        user, assistant = exchange(rng)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def main(out: Path) -> None:
    rng = random.Random(15)
    lines = [json.dumps(conversation(rng)) for _ in range(120)]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} conversations ({out.stat().st_size:,} bytes) to {out}")


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else root / "recipes/data/chat.jsonl")
