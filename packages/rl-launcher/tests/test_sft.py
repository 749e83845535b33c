"""SFT mode: prompt + response data with the loss on the response, trained through the
training actor group (real Ray, rl-fsdp over gloo, no engines); checkpoints, resume and
the Hugging Face export an RL run can start from."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rl_launcher.cli import main
from rl_launcher.config import DataConfig, DatasetConfig
from rl_launcher.config.loader import load_config
from rl_launcher.data.prompts import MalformedRow
from rl_launcher.data.sft import load_sft_dataset, sft_sample_from_row, split_response
from rl_launcher.eval_cli import resolve_model_dir
from rl_launcher.infra import checkpoints
from rl_launcher.infra.run_log import read_metrics
from rl_launcher.session.model import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "examples" / "quickstart" / "tokenizer"
SPEC = DatasetConfig(path="unused.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def additions() -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a in range(5) for b in range(5)]


def test_a_sample_is_prompt_then_response_and_eos_with_loss_on_the_response(tokenizer):
    sample = sft_sample_from_row(
        {"prompt": "3+4=", "response": "7"}, SPEC, tokenizer=tokenizer, apply_chat_template=False
    )
    # character ids: '3'=4 '+'=11 '4'=5 '='=14 '7'=8, <eos>=0
    assert sample.tokens == [4, 11, 5, 14, 8, 0]
    assert sample.response_length == 2 and sample.prompt_length == 4
    assert sample.effective_loss_mask() == [1, 1]


def test_chat_messages_end_in_the_assistant_turn_that_is_the_response():
    row = {"prompt": [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]}
    prompt_row, response = split_response(row, SPEC)
    assert response == "7" and prompt_row["prompt"] == [{"role": "user", "content": "3+4="}]
    for bad in ({"prompt": "3+4="}, {"prompt": "3+4=", "response": ""}, [1, 2]):
        with pytest.raises(MalformedRow):
            split_response(bad, SPEC)


def test_malformed_rows_are_counted_with_their_line_or_raised(tmp_path, tokenizer):
    path = write_rows(
        tmp_path / "sft.jsonl",
        [additions()[0], "{not json", {"prompt": "1+1="}, {"prompt": "4+4=", "response": "8"}],
    )
    spec = DatasetConfig(path=str(path))
    data = DataConfig(train=[spec], apply_chat_template=False)
    dataset = load_sft_dataset(spec, data, tokenizer=tokenizer, max_response_tokens=2)
    assert dataset.stats.rows == 4 and dataset.stats.kept == 2 and dataset.stats.malformed == 2
    assert dataset.stats.malformed_examples[0].startswith(f"{path}:2: invalid JSON")
    assert dataset.stats.malformed_examples[1].startswith(f"{path}:3: no response")
    short = load_sft_dataset(spec, data, tokenizer=tokenizer, max_response_tokens=1)
    assert short.stats.kept == 0 and short.stats.too_long == 2  # response + EOS is 2 tokens
    data.on_malformed = "raise"
    with pytest.raises(ValueError, match=rf"malformed row {path}:2: invalid JSON"):
        load_sft_dataset(spec, data, tokenizer=tokenizer, max_response_tokens=2)


def sft_args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    tree = yaml.safe_load((ROOT / "examples/quickstart/config.yaml").read_text())
    tree["data"]["train"] = [{"path": str(data)}]
    config = run_dir.parent / "sft.yaml"
    config.write_text(yaml.safe_dump(tree))
    return [
        "--config",
        str(config),
        "--mode",
        "sft",
        "--num_steps",
        "4",
        "--seed",
        "3",
        "--rollout.batch_size",
        "10",
        "--rollout.max_response_tokens",
        "2",
        "--optimizer.lr",
        "0.01",
        "--optimizer.schedule",
        "constant",
        "--model.tokenizer_path",
        str(TOKENIZER),
        "--data.apply_chat_template",
        "false",
        "--logging.run_dir",
        str(run_dir),
        "--checkpoint.interval",
        "2",
        "--checkpoint.save_hf",
        "true",
        *extra,
    ]


def answer_log_prob(model_dir: Path, tokenizer) -> float:
    """Mean log-prob of the right answer digit over all 25 additions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0.0
    for row in additions():
        ids = tokenizer.encode(row["prompt"] + row["response"], add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -2]
        total += float(logits.log_softmax(-1)[ids[-1]])
    return total / 25


@pytest.mark.integration
def test_sft_learns_checkpoints_exports_and_resumes(ray_cluster, tmp_path, capsys, tokenizer):
    data = write_rows(tmp_path / "sft.jsonl", additions())
    run_dir = tmp_path / "run"
    assert main(sft_args(run_dir, data, "--num_steps", "2")) == 0
    assert "step 2/2 | sft loss" in capsys.readouterr().out
    assert main([*sft_args(run_dir, data), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step 3/4" in out and "step 1/4" not in out
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    losses = [r["loss/sft"] for r in records]
    assert losses[-1] < losses[0]
    # every example's 2 response tokens count: 10 examples per step
    assert all(r["sft/response_length/mean"] == 2.0 for r in records)
    state = json.loads((run_dir / "checkpoints/step_000004/state.json").read_text())
    assert state["mode"] == "sft" and state["data"]["num_drawn"] == 40
    assert [s for s, _ in checkpoints.complete_checkpoints(run_dir / "checkpoints")] == [2, 4]
    hf = run_dir / "checkpoints/step_000004/hf"
    before = answer_log_prob(run_dir / "initial_model", tokenizer)
    assert answer_log_prob(hf, tokenizer) > before + 0.5  # the answers became likelier
    assert (hf / "tokenizer.json").is_file()  # an RL run can start from it (model.path)
    assert (run_dir / "plots" / "sft_loss.png").read_bytes()[:4] == b"\x89PNG"
    # rl-eval's export of a checkpoint without hf/: the same weights as the training export
    reference = tmp_path / "reference_hf"
    shutil.move(hf, reference)
    config, _ = load_config(sft_args(run_dir, data))
    assert resolve_model_dir(run_dir, config) == hf
    exported, expected = (
        load_file(next(hf.glob("*.safetensors"))),
        load_file(next(reference.glob("*.safetensors"))),
    )
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0)
