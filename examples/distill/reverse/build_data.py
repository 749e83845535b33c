"""Writes the reversal task's data: every 3-digit string and its reverse ("123=" -> "321").

    uv run --package rl-launcher python examples/distill/reverse/build_data.py

train.jsonl ({"prompt", "label"}) is what the RL runs sample from; sft.jsonl ({"prompt",
"response"}) is what the teacher and the student's warm-up learn from. The answer is three
tokens (one a digit), so the exact-match reward grades the whole of it while a teacher can
grade each digit.
"""

import itertools
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows() -> list[tuple[str, str]]:
    """(prompt, answer) for each of the 1000 strings of three digits."""
    strings = ("".join(digits) for digits in itertools.product("0123456789", repeat=3))
    return [(f"{s}=", s[::-1]) for s in strings]


def main() -> None:
    data = HERE / "data"
    data.mkdir(exist_ok=True)
    with (data / "train.jsonl").open("w") as rl, (data / "sft.jsonl").open("w") as sft:
        for prompt, answer in rows():
            rl.write(json.dumps({"prompt": prompt, "label": answer}) + "\n")
            sft.write(json.dumps({"prompt": prompt, "response": answer}) + "\n")


if __name__ == "__main__":
    main()
