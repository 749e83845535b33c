"""Write the agent example's data and tokenizer (both committed; rerun to regenerate).

    python examples/agent/build_assets.py

- ``data/train.jsonl``: "What is A*B+C?" with A, B, C in 2..9, label the value, 200 rows.
- ``data/sft.jsonl``: demonstrations for a short SFT warm-up (``sft.yaml``), prompts rendered
  as the gateway renders them (tools in the system turn). Half of the first turns call the
  calculator, half guess a number without it; every second turn answers with the tool's
  result. The warm-up teaches the format and leaves GRPO the choice worth learning: call
  the tool (a random-initialised byte model never writes a well-formed call by chance).
- ``tokenizer/``: byte-level (one token per byte), ChatML special tokens
  ``<|im_start|>`` / ``<|im_end|>`` (EOS) and a ChatML chat template with Hermes-style
  tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), the format the
  gateway parses.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TEMPLATE = (
    '{%- if tools %}{{ \'<|im_start|>system\\nCall a tool as <tool_call>{"name": ..., '
    "\"arguments\": {...}}</tool_call>. Tools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>' + ({'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>' + m.content + "
    "'</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_data(path: Path) -> int:
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        a, b, c = (rng.randint(2, 9) for _ in range(3))
        rows.append({"prompt": f"What is {a}*{b}+{c}?", "label": str(a * b + c)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def write_sft_data(path: Path, tokenizer_path: Path) -> int:
    from calculator_agent import TOOLS
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    rng = random.Random(1)
    rows = []
    for _ in range(400):
        a, b, c = (rng.randint(2, 9) for _ in range(3))
        user = [{"role": "user", "content": f"What is {a}*{b}+{c}?"}]
        first = tokenizer.apply_chat_template(
            user, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}+{c}"}})
        if rng.random() < 0.5:
            rows.append({"prompt": first, "response": f"{rng.randint(10, 90)}"})
            continue
        rows.append({"prompt": first, "response": f"<tool_call>{call}</tool_call>"})
        second = (
            f"{first}<tool_call>{call}</tool_call><|im_end|>\n<|im_start|>user\n"
            f"<tool_response>{a * b + c}</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        rows.append({"prompt": second, "response": str(a * b + c)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def write_tokenizer(path: Path) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rl_sglang.tiny import byte_tokenizer

    vocab = dict(byte_tokenizer().backend_tokenizer.get_vocab())  # bytes 0..255, 256 spare
    for token in ("<|im_start|>", "<|im_end|>"):
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return len(tokenizer)


if __name__ == "__main__":
    print("rows:", write_data(HERE / "data" / "train.jsonl"))
    print("vocab:", write_tokenizer(HERE / "tokenizer"))
    print("sft rows:", write_sft_data(HERE / "data" / "sft.jsonl", HERE / "tokenizer"))
