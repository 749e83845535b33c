"""Write the multi-turn example's data and tokenizer (both committed; rerun to regenerate).

    python examples/multiturn/build_assets.py

- ``data/train.jsonl``: additions of two operands 0..9 ("3+8=" -> "11"), 100 prompts;
  label = the sum (one or two digits). ``data/sft.jsonl``: the same prompts with a
  demonstrated response ``<calc>3+8</calc><result>11</result>11`` (for ``sft.yaml``).
- ``tokenizer/``: character-level (the ``tokenizers`` library) over ``<eos>``, the digits,
  ``+ - * =``, space, lowercase letters and ``:`` (the calculator's error messages), and the
  four tool tags ``<calc> </calc> <result> </result>`` as single (non-special) tokens, so the
  reward sees them in the decoded response.
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
TAGS = ["<calc>", "</calc>", "<result>", "</result>"]
SYMBOLS = ["<eos>", *"0123456789", "+", "-", "*", "=", " ", *TAGS, *"abcdefghijklmnopqrstuvwxyz:"]


def write_data(path: Path) -> int:
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def write_demonstrations(path: Path) -> int:
    """SFT rows showing the tool call, its result and the answer (for sft.yaml)."""
    rows = [
        {"prompt": f"{a}+{b}=", "response": f"<calc>{a}+{b}</calc><result>{a + b}</result>{a + b}"}
        for a in range(10)
        for b in range(10)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def write_tokenizer(path: Path) -> int:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(
        models.WordLevel(vocab={s: i for i, s in enumerate(SYMBOLS)}, unk_token="<eos>")
    )
    pattern = "|".join(tag.replace("/", "\\/") for tag in TAGS) + "|."
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<eos>", unk_token="<eos>"
    )
    tokenizer.save_pretrained(path)
    return len(tokenizer)


if __name__ == "__main__":
    print("rows:", write_data(HERE / "data" / "train.jsonl"))
    print("demonstrations:", write_demonstrations(HERE / "data" / "sft.jsonl"))
    print("vocab:", write_tokenizer(HERE / "tokenizer"))
