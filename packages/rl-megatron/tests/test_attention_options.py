"""The options against per-shape attention costs (issue 22), each checked on CPU against the
run without it: ``attention_backends="no_cudnn"`` restricts SDPA's kernels (eager and in
compiled layers) and ``width_bucket`` pads rows to coarser widths; both leave the
log-probs, loss and gradients as they were. Also ``bench/train_megatron.py --data varied``,
the run that shows the cost, on the tiny shape."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny
import torch
from test_levers import LENGTHS, _assert_same, _run

from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig

BENCH = Path(__file__).parents[3] / "bench" / "train_megatron.py"


def _record_cudnn_flag(monkeypatch) -> list[bool]:
    """Whether SDPA's cuDNN kernel was allowed at each eager SDPA call."""
    flags = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        flags.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    return flags


def test_no_cudnn_restricts_sdpa_and_changes_nothing(world1, model_dirs, monkeypatch):
    flags = _record_cudnn_flag(monkeypatch)
    auto = _run(model_dirs, "qwen3")
    assert flags and all(flags)  # SDPA's own choice: cuDNN allowed
    flags.clear()
    restricted = _run(model_dirs, "qwen3", attention_backends="no_cudnn")
    assert flags and not any(flags)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each call
    _assert_same(restricted, auto, atol=0)  # the same CPU kernel: bit for bit


def test_no_cudnn_compiles_without_graph_breaks(world1, model_dirs):
    """The restriction is traced into the compiled layers: no graph break, the eager
    results (float32: inductor's fused kernels reorder sums, measured <= 5e-7)."""
    from torch._dynamo.utils import counters

    from rl_core.compiling import compile_report

    eager = _run(model_dirs, "qwen3", attention_backends="no_cudnn")
    torch._dynamo.reset()
    counters.clear()
    compiled = _run(model_dirs, "qwen3", attention_backends="no_cudnn", compile_layers=True)
    _assert_same(compiled, eager, atol=2e-6)
    report = compile_report()
    assert report["graph_breaks"] == 0, report["break_reasons"]
    assert not report["failures"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_width_bucket_pads_rows_without_changing_results(world1, model_dirs, precision):
    """Widths 14 and 20 padded to 16 and 32: padding is masked (right padding, causal),
    so the real tokens' log-probs, the loss and the gradients are the unbucketed run's
    up to the matmuls' rounding, whose CPU kernels block by the token count (measured:
    log-probs within 4.8e-7 in fp32, 2.0e-3 in bf16)."""
    batches = (LENGTHS, [7, 20, 3])
    plain = _run(model_dirs, "qwen3", batches, precision=precision)
    bucketed = _run(model_dirs, "qwen3", batches, precision=precision, width_bucket=16)
    for got, expected in zip(bucketed, plain, strict=True):
        _assert_same(got, expected, atol=1e-6 if precision == "fp32" else 1e-2)


def test_micro_batch_shapes_follow_the_bucket(world1, model_dirs):
    def shapes(**options):
        config = MegatronConfig(hf_path=model_dirs["qwen3"][0], device="cpu", **options)
        batch = tiny.random_batch([7, 20, 3, 40], seed=1)
        return MegatronBackend(config).micro_batch_shapes(batch)

    assert shapes(max_tokens_per_micro_batch=64) == [(1, 40), (3, 20)]
    assert shapes(max_tokens_per_micro_batch=64, width_bucket=16) == [(1, 48), (3, 32)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attention_backends": "cudnn_only"}, "attention_backends must be one of 'auto'"),
        ({"width_bucket": 0}, "width_bucket must be positive"),
    ],
)
def test_bad_options_are_refused_by_name(model_dirs, options, message):
    with pytest.raises(ValueError, match=message):
        MegatronConfig(hf_path=model_dirs["qwen3"][0], device="cpu", **options)


def test_bench_varied_data_reports_per_step_shapes_and_times(tmp_path):
    """The bench's RL-like mode on the tiny shape (CPU shim): two passes over fresh
    batches, per-step seconds, bucketed shapes, the options in the levers."""
    command = [
        sys.executable,
        str(BENCH),
        "--shape=tiny",
        "--device=cpu",
        "--data=varied",
        "--steps=3",
        "--warmup=1",
        "--width-bucket=16",
        "--attention-backends=no_cudnn",
    ]
    done = subprocess.run(
        command, cwd=BENCH.parent, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figure = json.loads(done.stdout)["figure"]
    per_step = figure["per_step"]
    assert len(per_step["first_pass_s"]) == len(per_step["second_pass_s"]) == 3
    assert per_step["compiled_graphs"] == [0, 0, 0]  # eager layers on CPU
    assert all(seconds > 0 for seconds in per_step["first_pass_s"] + per_step["second_pass_s"])
    widths = {width for step in per_step["shapes"] for _, width in step}
    assert widths and all(width % 16 == 0 for width in widths), widths
    assert per_step["distinct_shapes"] >= len(
        {tuple(s) for step in per_step["shapes"] for s in step}
    )
    assert figure["levers"]["attention_backends"] == "no_cudnn"
    assert figure["levers"]["width_bucket"] == 16
    assert figure["steady"]["tokens_per_s"] > 0


def test_bucketed_widths_keep_one_compiled_graph(world1, model_dirs):
    """The compiled layers' token dimension is dynamic, so widths 14 and 20 share a graph
    either way; a width of 1 (two one-token rows) makes dynamo specialise (0/1) and compile
    the training and log-prob graphs again, which a bucket of 16 never does."""
    from torch._dynamo.utils import counters

    batches = (LENGTHS, [1, 1], [7, 20, 3])
    counts = {}
    for bucket in (1, 16):
        torch._dynamo.reset()
        counters.clear()
        graphs = counts[bucket] = []
        _run(model_dirs, "qwen3", batches, graphs, compile_layers=True, width_bucket=bucket)
    assert counts[1][0] == 2 and counts[1][1] > 2, counts
    assert counts[16] == [2, 2, 2], counts
