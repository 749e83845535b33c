"""``rl-convert``: the console script run as users run it (a subprocess that spawns its gloo
ranks), round trips bit-identical through TP=2, PP=2 and EP=2 layouts and back under
another layout (megatron reshards), a backend training checkpoint to HF, atomic outputs,
and one-line errors before any rank starts."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiny
import torch

from rl_megatron import cli


def rl_convert(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The installed console script (this environment's), as a user runs it."""
    script = shutil.which("rl-convert", path=str(Path(sys.executable).parent))
    assert script, "rl-convert is not installed: uv sync --all-packages"
    command = [script]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def assert_same_files(directory, original_dir) -> None:
    original, converted = tiny.hf_files(original_dir), tiny.hf_files(directory)
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert converted[name].dtype == tensor.dtype, name
        assert torch.equal(converted[name], tensor), name


def assert_converted(done: subprocess.CompletedProcess, output) -> None:
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"rl-convert: wrote {output}"), done.stdout
    assert not [p.name for p in output.parent.iterdir() if p.name.startswith(".")]  # no temp


@pytest.mark.integration
def test_tp2_to_pp2_round_trip_is_bit_identical(model_dirs, tmp_path):
    """HF -> Megatron at TP=2 (two ranks) -> HF at PP=2 (two other ranks; tied embeddings
    on both stages): the original tensors, bit for bit, with the tokenizer-side files."""
    source = model_dirs["qwen2-tied"][0]
    megatron = tmp_path / "megatron"
    assert_converted(
        rl_convert("hf-to-megatron", "--hf", str(source), "--out", str(megatron), "--tp", "2"),
        megatron,
    )
    meta = json.loads((megatron / "meta.json").read_text())
    assert meta["saved_layout"]["tp"] == 2 and meta["world_size"] == 2
    assert (megatron / "hf" / "config.json").is_file()
    back = tmp_path / "back"
    done = rl_convert(
        "megatron-to-hf", "--ckpt", str(megatron), "--out", str(back), "--tp", "1", "--pp", "2"
    )
    assert_converted(done, back)
    assert '"pp": 2' in done.stdout
    assert_same_files(back, source)
    assert (back / "generation_config.json").is_file()


@pytest.mark.integration
def test_ep2_round_trip_of_an_moe_model_to_bfloat16(model_dirs, tmp_path):
    """Experts split over two EP ranks and gathered back on one; ``--dtype bfloat16``
    writes every tensor rounded once (and says so in config.json)."""
    source = model_dirs["qwen3-moe"][0]
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    assert_converted(
        rl_convert("hf-to-megatron", "--hf", str(source), "--out", str(megatron), "--ep", "2"),
        megatron,
    )
    assert_converted(
        rl_convert(
            "megatron-to-hf",
            "--ckpt",
            str(megatron),
            "--out",
            str(back),
            "--ep",
            "1",
            "--dtype",
            "bfloat16",
        ),
        back,
    )
    original, converted = tiny.hf_files(source), tiny.hf_files(back)
    assert set(converted) == set(original)
    assert all(torch.equal(converted[n], t.to(torch.bfloat16)) for n, t in original.items())
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.integration
def test_a_training_checkpoint_converts_to_the_backends_own_export(world1, model_dirs, tmp_path):
    """A step of training, the backend's checkpoint, rl-convert with --config: the same
    HF tensors as the backend's export_hf (and not the initial ones: the step moved them).
    The config of another model is refused in one line naming the first missing weight."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    source = model_dirs["qwen3"][0]
    backend = MegatronBackend(MegatronConfig(hf_path=source, device="cpu", lr=1e-2))
    backend.train_step(tiny.random_batch([9, 14, 6], seed=2))
    backend.save_checkpoint(tmp_path / "step_1")
    backend.export_hf(tmp_path / "expected")
    out = tmp_path / "converted"
    assert_converted(
        rl_convert(
            "megatron-to-hf",
            "--ckpt",
            str(tmp_path / "step_1"),
            "--config",
            str(source),
            "--out",
            str(out),
        ),
        out,
    )
    assert_same_files(out, tmp_path / "expected")
    moved = tiny.hf_files(out)["model.norm.weight"] - tiny.hf_files(source)["model.norm.weight"]
    assert float(moved.abs().max()) > 1e-3
    wrong = rl_convert(
        "megatron-to-hf",
        "--ckpt",
        str(tmp_path / "step_1"),
        "--config",
        str(model_dirs["llama"][0]),
        "--out",
        str(tmp_path / "wrong"),
    )
    assert wrong.returncode == 1
    assert wrong.stderr.strip().splitlines()[-1] == (
        f"rl-convert: error: megatron-to-hf failed: ValueError: {tmp_path / 'step_1'} does not "
        f"hold the model of {model_dirs['llama'][0]}: decoder.layers.self_attention.q_layernorm"
        ".weight is not in that model; give --config the HF directory the checkpoint was made "
        "from"
    )
    assert not (tmp_path / "wrong").exists()


def test_help_names_both_directions_and_the_layout_flags(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "hf-to-megatron" in text and "megatron-to-hf" in text and "tp * pp * ep" in text
    with pytest.raises(SystemExit):
        cli.main(["hf-to-megatron", "--help"])
    sub = capsys.readouterr().out
    assert all(flag in sub for flag in ("--tp N", "--pp N", "--ep N", "--dtype", "--overwrite"))


def refusal(capsys, *args) -> str:
    """The one line ``rl-convert`` prints for arguments refused before any rank starts."""
    assert cli.main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rl-convert: error: "), lines
    return lines[0]


def test_errors_are_one_line_before_any_rank_starts(capsys, model_dirs, tmp_path):
    qwen3, moe = str(model_dirs["qwen3"][0]), str(model_dirs["qwen3-moe"][0])
    out, gemma = str(tmp_path / "out"), tmp_path / "gemma"
    tiny.save_tiny_model(gemma, "gemma")
    capsys.readouterr()  # its save's progress bar
    assert "has no config.json" in refusal(capsys, "hf-to-megatron", "--hf", out, "--out", out)
    assert "tp=3 must divide both attention heads (4)" in refusal(
        capsys, "hf-to-megatron", "--hf", qwen3, "--out", out, "--tp", "3"
    )
    assert "--pp 4 must divide the number of layers (2)" in refusal(
        capsys, "hf-to-megatron", "--hf", qwen3, "--out", out, "--pp", "4"
    )
    assert "qwen3 has none; use --ep 1" in refusal(
        capsys, "hf-to-megatron", "--hf", qwen3, "--out", out, "--ep", "2"
    )
    assert "--ep 3 must divide the number of experts (4)" in refusal(
        capsys, "hf-to-megatron", "--hf", moe, "--out", out, "--ep", "3"
    )
    assert "exists; choose another output or pass --overwrite" in refusal(
        capsys, "hf-to-megatron", "--hf", qwen3, "--out", qwen3
    )
    assert "is not a complete checkpoint (no meta.json)" in refusal(
        capsys, "megatron-to-hf", "--ckpt", qwen3, "--out", out
    )
    assert "rl-megatron: gemma (scaled embeddings" in refusal(
        capsys, "hf-to-megatron", "--hf", str(gemma), "--out", out
    )
    assert not (tmp_path / "out").exists()


def test_the_way_back_refuses_a_tp_that_pads_the_vocabulary_differently(capsys, tmp_path):
    """A checkpoint saved at TP=1 (500 -> 512 rows) cannot load at TP=8 (1024 rows)."""
    config = tiny.hf_config("qwen3", num_attention_heads=8, num_key_value_heads=8)
    config.save_pretrained(tmp_path / "ckpt" / "hf")
    meta = {"format": "megatron_dist", "mode": "weights", "saved_layout": {"tp": 1}}
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps(meta))
    line = refusal(
        capsys,
        "megatron-to-hf",
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / "out"),
        "--tp",
        "8",
    )
    assert "tp=8 pads the vocabulary to another size than the saved tp=1 (512 rows)" in line
