"""What the embedded engine says while it starts: a line per phase with its time, and the
one-line TF32 hint for float32 matmuls on CUDA (decided here without a GPU)."""

import pytest
import torch

from rl_sglang.engine.precision import TF32_OFF, tf32_hint


@pytest.fixture
def precision():
    """Leaves torch's float32 matmul precision as it found it."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_tf32_hint_only_for_float32_on_cuda_at_the_highest_precision(precision):
    precision("highest")  # torch's default
    assert tf32_hint("cuda", torch.float32) == TF32_OFF
    assert tf32_hint(torch.device("cuda", 1), torch.float32) == TF32_OFF
    assert "set_float32_matmul_precision('high')" in TF32_OFF and "\n" not in TF32_OFF
    assert tf32_hint("cuda", torch.bfloat16) is None
    assert tf32_hint("cpu", torch.float32) is None
    precision("high")  # TF32 on: nothing to say
    assert tf32_hint("cuda", torch.float32) is None


@pytest.mark.integration
def test_engine_log_has_a_line_per_start_up_phase(cluster):
    """The engines of the shared cluster (tiny model, CPU): model loaded, then the runner
    prepared, each with its time; no TF32 hint on a CPU. The tiny model's slot cache is small,
    so ``auto`` serves it with the static runner on the CPU too."""
    for engine in cluster.engines:
        log = engine.log_path.read_text(errors="replace")
        loaded = log.index("embedded engine: model loaded in ")
        assert "s (cpu, float32); preparing the runner" in log[loaded:]
        ready = log.index(f"embedded engine ready on {engine.url} (static runner, float32, ")
        line = log[ready:].splitlines()[0]
        assert loaded < ready and "runner prepared in " in line
        assert ", decode attention sdpa;" in line  # the CPU's attention, no sampled rounds
        assert "TF32" not in log


@pytest.mark.integration
def test_engine_stopped_by_sigterm_says_so_and_exits_0(tiny_dir, tmp_path):
    """SIGTERM: the server finishes its shutdown (the line after it) and the process exits
    0 without the interpreter's teardown (embedded.exit_now)."""
    from rl_sglang.process import EmbeddedEngine

    engine = EmbeddedEngine(tiny_dir, log_dir=tmp_path).start()
    engine.stop()
    assert engine.process.returncode == 0
    lines = engine.log_path.read_text(errors="replace").splitlines()
    assert lines[-1] == "embedded engine: shut down"
