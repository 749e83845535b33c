"""Chunked log-prob + entropy (rl_core.logprobs) against the plain log_softmax path.

Measures, in the same run and on the same logits: peak extra memory (above the logits and
tokens already allocated) and wall time, forward only (the old/ref log-prob pass) and
forward + backward (the training pass). Prints one JSON object.

    python bench/logprobs.py                      # CPU: 2048 tokens x 151,936 vocab, fp32
    python bench/logprobs.py --device cuda        # GPU: 8192 tokens x 151,936 vocab, bf16
"""

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from rl_core.logprobs import log_probs_and_entropy


def plain_log_probs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor):
    """The usual code: one float32 log_softmax over the whole [tokens, vocab] tensor."""
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    log_probs = log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


class PeakMemory:
    """Peak bytes allocated above the level at entry (CUDA allocator or process RSS)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
                f.write("5")
            self.start = _proc_status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.peak = _proc_status_kib("VmHWM") * 1024 - self.start


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_once(fn: Callable, logits: torch.Tensor, tokens: torch.Tensor, backward: bool):
    if backward:
        leaf = logits.detach().requires_grad_()
        log_probs, entropy = fn(leaf, tokens)
        (log_probs.sum() + 0.01 * entropy.sum()).backward()
        return leaf.grad
    with torch.no_grad():
        return fn(logits, tokens)


def measure(fn, logits, tokens, *, backward: bool, repeats: int) -> dict:
    device = logits.device
    run_once(fn, logits, tokens, backward)  # warm-up (kernels, allocator)
    with PeakMemory(device) as memory:
        out = run_once(fn, logits, tokens, backward)
        del out
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = run_once(fn, logits, tokens, backward)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del out
    return {"peak_extra_bytes": memory.peak, "seconds": statistics.median(times)}


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=None, help="default 8192 on GPU, 2048 on CPU")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    num_tokens = args.tokens or (8192 if on_gpu else 2048)
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))

    torch.manual_seed(0)
    logits = torch.randn(num_tokens, args.vocab, device=device).to(dtype)
    tokens = torch.randint(0, args.vocab, (num_tokens,), device=device)

    variants = {"chunked_torch": "torch"}
    if on_gpu:
        variants["fused_triton"] = "triton"
    results = {}
    for phase, backward in (("forward", False), ("forward_backward", True)):
        plain = measure(
            plain_log_probs_and_entropy, logits, tokens, backward=backward, repeats=args.repeats
        )
        results[phase] = {"plain": plain}
        for name, backend in variants.items():

            def ours_fn(x, t, backend=backend):
                return log_probs_and_entropy(x, t, chunk_size=args.chunk_size, backend=backend)

            ours = measure(ours_fn, logits, tokens, backward=backward, repeats=args.repeats)
            results[phase][name] = {
                **ours,
                "memory_ratio": ours["peak_extra_bytes"] / max(plain["peak_extra_bytes"], 1),
                "time_ratio": ours["seconds"] / plain["seconds"],
            }
    print(
        json.dumps(
            {
                "bench": "logprobs",
                "tokens": num_tokens,
                "vocab": args.vocab,
                "dtype": str(dtype).removeprefix("torch."),
                "chunk_size": args.chunk_size,
                "hardware": hardware(device),
                "torch": torch.__version__,
                "command": " ".join(["python", *sys.argv]),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
