"""The synchronous loop end to end on CPU with real Ray, an embedded engine behind the real
sglang-router and an rl-fsdp training actor: the quickstart config shrunk to a few steps."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from rl_launcher.cli import main
from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.infra import checkpoints
from rl_launcher.infra.run_log import read_metrics
from rl_launcher.loops.rl import run_step
from rl_launcher.session.start import engines_start_first, start_run

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart" / "config.yaml"
LOGPROB_TOL = 1e-4  # engine (HF forward, continuous batching) vs trainer (packed FSDP forward)


def shrunk(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(QUICKSTART),
        "--num_steps",
        "3",
        "--rollout.batch_size",
        "4",
        "--rollout.group_size",
        "4",
        "--algorithm.entropy_coef",
        "0.1",
        "--optimizer.lr",
        "0.01",
        "--logging.run_dir",
        str(run_dir),  # entropy: never a zero gradient
        "--model.tokenizer_path",
        str(ROOT / "examples/quickstart/tokenizer"),
        "--data.train.0.path",
        str(ROOT / "examples/quickstart/data/train.jsonl"),
        "--checkpoint.interval",
        "2",
        *extra,
    ]


def engine_response(run, prompt_ids: list[int], engine: int = 0) -> dict:
    """One sampled response with its engine log-probs, straight from engine ``engine``."""
    from rl_sglang.client import EngineClient

    async def ask():
        async with EngineClient(run.rollout.engines.urls[engine]) as client:
            params = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}
            return await client.generate(
                input_ids=prompt_ids, sampling_params=params, return_logprob=True
            )

    return asyncio.run(ask())


def trainer_log_probs(run, prompt_ids: list[int], output: dict) -> torch.Tensor:
    """The training actor's log-probs ``[R]`` of the engine's response tokens."""
    from rl_core.batch import batch_from_samples
    from rl_core.types import Sample

    ids = list(output["output_ids"])
    sample = Sample(tokens=prompt_ids + ids, response_length=len(ids))
    batch = batch_from_samples([sample])
    per_rank = run.trainer.log_probs([batch] * run.num_ranks)  # every rank, same sequence
    for other in per_rank[1:]:
        torch.testing.assert_close(other, per_rank[0], atol=0, rtol=0)
    return per_rank[0][batch.loss_mask > 0]


def initial_log_probs(model_dir: Path, prompt_ids: list[int], output: dict) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = torch.tensor([prompt_ids + list(output["output_ids"])])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(prompt_ids) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, tokens[0, len(prompt_ids) :, None])[:, 0]


def test_two_ranks_sync_weights_and_engine_log_probs_match_the_trainer(tmp_path):
    # two training ranks (two Ray actors in one gloo group) beside one engine
    config, _ = load_config(shrunk(tmp_path / "run", "--cluster.devices_per_node", "2"))
    run = start_run(config)
    try:
        assert run.num_ranks == 2 and len(run.rollout.engines.urls) == 1
        buffer = DataBuffer.from_config(config, num_ranks=run.num_ranks)
        records = [run_step(run, buffer, step) for step in (1, 2)]
        assert run.rollout.engines.weight_versions() == ["2"]
        prompt_ids = run.source.datasets[0].prompts[0].tokens
        output = engine_response(run, prompt_ids)
        engine = torch.tensor([lp for lp, _, *_ in output["meta_info"]["output_token_logprobs"]])
        trainer = trainer_log_probs(run, prompt_ids, output)
        before = initial_log_probs(tmp_path / "run" / "initial_model", prompt_ids, output)
    finally:
        run.close()
    assert [r["sync/weight_version"] for r in records] == [1.0, 2.0]
    assert [r["rollout/weight_version_min"] for r in records] == [0.0, 1.0]
    assert all(r["mismatch/logprob_abs_diff_max"] < LOGPROB_TOL for r in records)
    for r in records:  # the workers' compute time fits inside the phases that wait for it
        assert 0 < r["time/log_probs_compute"] <= r["time/log_probs"]
        assert 0 < r["time/train_compute"] <= r["time/train"]
        assert r["perf/train_tokens_per_s"] >= r["perf/train_tokens_per_s_wall"] > 0
        assert 0 <= r["time/overhead"] < r["time/step"]
        assert r["time/train_dispatch"] >= 0 and r["time/train_return"] >= 0
        assert r["time/train_dispatch"] + r["time/train_return"] < r["time/train"]
        assert r["time/train_compute"] <= r["time/train_call"] <= r["time/train"]
        assert "time/train_entered_at" not in r
    assert engine.shape == trainer.shape == (3,)
    torch.testing.assert_close(engine, trainer, atol=LOGPROB_TOL, rtol=0)
    # the match is not trivial: two steps at lr 1e-2 moved these log-probs far more than that
    assert (engine - before).abs().max() > 100 * LOGPROB_TOL


def test_engines_start_before_ray_only_on_a_lone_cpu_node():
    assert engines_start_first(load_config([])[0])
    for override in (
        ["--cluster.device", "cuda"],  # devices come from the placement
        ["--cluster.num_nodes", "2", "--cluster.devices_per_node", "1"],
        ["--cluster.ray_address", "10.0.0.1:6379"],
        ["--rollout.data_plane", "workers"],  # workers go to the engines' nodes
    ):
        assert not engines_start_first(load_config(override)[0]), override


def test_cli_trains_checkpoints_and_resumes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    kl = ("--algorithm.kl_coef", "0.01")  # the reference model's log-probs join the loss
    assert main(shrunk(run_dir, "--num_steps", "2", *kl)) == 0
    out = capsys.readouterr().out
    assert "step 2/2 | reward" in out
    # Ray started by this run, on this CPU machine alone: the engine loaded while it started
    assert out.index("engine(s) loading while Ray starts") < out.index("Ray ready")
    assert [s for s, _ in checkpoints.complete_checkpoints(run_dir / "checkpoints")] == [2]
    assert main(shrunk(run_dir, *kl)) == 2  # a second fresh run into the same directory
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert main([*shrunk(run_dir, *kl), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step 3/3" in out and "step 1/3" not in out
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss/kl"] >= 0 for r in records) and records[2]["loss/kl"] > 0
    # garbage-collection pauses, the driver's and the trainer's (start-up objects frozen)
    assert all(r["time/gc"] >= r["time/gc_max"] >= 0 and r["time/trainer_gc"] >= 0 for r in records)
    # the fresh engines got the checkpoint's weights (version 2) before step 3's rollout
    assert records[2]["rollout/weight_version_min"] == 2.0
    assert records[2]["mismatch/logprob_abs_diff_max"] < LOGPROB_TOL
    state = json.loads((run_dir / "checkpoints/step_000003/state.json").read_text())
    assert state["step"] == 3 and state["data"]["num_drawn"] == 12
    assert (run_dir / "plots" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every engine (one per rl-train call) shut down cleanly: it let go of the trainer's
    # kept weight buffer before the trainer (and torch's shared-memory manager) went away
    engine_logs = [p.read_text() for p in (run_dir / "logs").glob("embedded-*.log")]
    assert len(engine_logs) == 2 and all("shut down" in log for log in engine_logs)
    assert not any("terminate called" in log or "Broken pipe" in log for log in engine_logs)


def test_reinforce_pp_with_a_kl_shaped_reward(tmp_path):
    """rl-train with reward_kl_coef: the reference is loaded and the reward's KL is that of
    the step's old policy to it: 0 at step 1 (the policy is the reference), not at step 2."""
    run_dir = tmp_path / "run"
    shaped = (
        "--algorithm.advantage_estimator",
        "reinforce_plus_plus",
        "--algorithm.reward_kl_coef",
        "0.1",
    )
    assert main(shrunk(run_dir, "--num_steps", "2", "--checkpoint.interval", "0", *shaped)) == 0
    first, second = read_metrics(run_dir)
    assert abs(first["algorithm/reward_kl_mean"]) < 1e-6
    assert abs(second["algorithm/reward_kl_mean"]) > 1e-4  # one step at lr 1e-2 moved it
    assert "loss/kl" not in second  # the loss has no KL term (algorithm.kl_coef = 0)
