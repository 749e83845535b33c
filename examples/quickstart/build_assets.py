"""Write the quickstart's data and tokenizer (both are committed; rerun to regenerate).

    python examples/quickstart/build_assets.py

- ``data/train.jsonl``: every addition of two operands 0..4 ("3+4=" -> "7"), 25 prompts,
  label = the answer (one digit).
- ``tokenizer/``: a character-level tokenizer (the ``tokenizers`` library, saved as
  tokenizer.json + tokenizer_config.json) over 16 symbols: ``<eos>``, the digits,
  ``+ - * =`` and space. The model's vocabulary is exactly these 16 tokens.
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
MAX_OPERAND = 4
SYMBOLS = ["<eos>", *"0123456789", "+", "-", "*", "=", " "]


def write_data(path: Path) -> int:
    rows = [
        {"prompt": f"{a}+{b}=", "label": str(a + b)}
        for a in range(MAX_OPERAND + 1)
        for b in range(MAX_OPERAND + 1)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def write_tokenizer(path: Path) -> int:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: index for index, symbol in enumerate(SYMBOLS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<eos>", unk_token="<eos>"
    )
    tokenizer.save_pretrained(path)
    return len(tokenizer)


if __name__ == "__main__":
    print("rows:", write_data(HERE / "data" / "train.jsonl"))
    print("vocab:", write_tokenizer(HERE / "tokenizer"))
