"""The loop's parts that need no processes: checkpoints on disk, the reward adapter,
minibatch splitting, the starting model and the fsdp config mapping."""

import json
from pathlib import Path

import pytest
import torch

from rl_core.batch import batch_from_samples
from rl_core.types import Sample
from rl_launcher.config.loader import load_config
from rl_launcher.infra import checkpoints
from rl_launcher.loops.step import Clock, minibatches
from rl_launcher.loops.step_metrics import mismatch
from rl_launcher.roles.reward import RewardError, load_reward
from rl_launcher.roles.train_group import cpu_threads_env, fsdp_config
from rl_launcher.session.model import build_tiny_model, load_tokenizer, prepare_model

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "examples" / "quickstart" / "tokenizer"


def test_newest_checkpoint_ignores_incomplete_ones_and_prune_keeps_the_last(tmp_path):
    for step in (2, 4, 6):
        path = checkpoints.step_path(tmp_path, step)
        path.mkdir()
        if step != 6:  # step 6 died before its state.json: not complete
            checkpoints.write_state(path, {"step": step})
    path, state = checkpoints.newest(tmp_path)
    assert path.name == "step_000004" and state == {"step": 4}
    checkpoints.prune(tmp_path, keep_last=1)
    assert [s for s, _ in checkpoints.complete_checkpoints(tmp_path)] == [4]
    assert checkpoints.newest(tmp_path / "missing") is None


def sample(prompt: list[int], response: list[int], label=None) -> Sample:
    return Sample(tokens=prompt + response, response_length=len(response), label=label, index=0)


def raising_reward(response: str, label: str) -> float:
    raise ZeroDivisionError("broken verifier")


def test_reward_sees_the_response_without_eos_and_names_a_failing_reward():
    tokenizer = load_tokenizer(TOKENIZER)
    prompt = tokenizer.encode("3+4=", add_special_tokens=False)
    seven = tokenizer.encode("7", add_special_tokens=False)
    reward = load_reward("exact_match", tokenizer)
    assert reward(sample(prompt, [*seven, tokenizer.eos_token_id], "7")) == 1.0
    assert reward(sample(prompt, seven + seven, "7")) == 0.0
    failing = load_reward(f"{__name__}:raising_reward", tokenizer)  # a dotted path
    with pytest.raises(RewardError, match=r"raising_reward' failed on sample 0 \(response '7'"):
        failing(sample(prompt, seven, label="7"))
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        load_reward("nope", tokenizer)


def test_minibatches_partition_the_step_with_their_own_denominators():
    samples = [sample([1, 2], [3] * n) for n in (1, 2, 3, 4, 5, 6)]
    full = batch_from_samples(samples, [1.0] * 6)
    ranks = [full.select([0, 2, 4]), full.select([1, 3, 5])]
    parts = minibatches(ranks, 3)
    assert len(parts) == 3 and minibatches(ranks, 1) == [ranks]
    # minibatch m holds each rank's sequences m, m+3, ...: here one per rank
    assert [[b.num_seqs for b in part] for part in parts] == [[1, 1]] * 3
    # response tokens (1+2), (3+4), (5+6): the denominators of the whole minibatch
    assert [part[0].global_num_tokens for part in parts] == [3.0, 7.0, 11.0]
    assert all(b.global_num_seqs == 2.0 for part in parts for b in part)
    assert sum(float(b.loss_mask.sum()) for part in parts for b in part) == 21.0


def test_mismatch_reads_only_response_positions():
    batch = batch_from_samples([sample([1, 2], [3, 4])], [1.0])
    batch.rollout_log_probs = torch.tensor([0.0, -1.0, -2.0, 0.0])
    batch.old_log_probs = torch.tensor([9.0, -1.5, -2.0, 9.0])  # 9s: positions without loss
    assert mismatch([batch]) == {
        "mismatch/logprob_abs_diff_mean": 0.25,
        "mismatch/logprob_abs_diff_max": 0.5,
    }


def test_starting_model_is_seeded_and_checks_the_vocabulary(tmp_path):
    config, _ = load_config(["--config", str(ROOT / "examples/quickstart/config.yaml")])
    config.model.tokenizer_path = str(TOKENIZER)
    path, tokenizer = prepare_model(config.model, run_dir=tmp_path, seed=3)
    saved = json.loads((path / "config.json").read_text())
    assert saved["vocab_size"] == len(tokenizer) == 16 and saved["eos_token_id"] == 0
    again = build_tiny_model(config.model.init_config, tokenizer, seed=3)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), (_, b) in zip(again.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="vocab_size=8 is smaller than the tokenizer's 16"):
        build_tiny_model({**config.model.init_config, "vocab_size": 8}, tokenizer, seed=0)
    config.model.tokenizer_path = None
    with pytest.raises(ValueError, match=r"set model\.tokenizer_path"):
        prepare_model(config.model, run_dir=tmp_path / "other", seed=3)


def test_fsdp_config_carries_the_algorithm_and_optimizer(tmp_path):
    config, _ = load_config(
        [
            "--algorithm.kl_coef",
            "0.01",
            "--optimizer.grad_clip",
            "0",
            "--num_steps",
            "7",
            "--optimizer.schedule",
            "cosine",
            "--rollout.temperature",
            "0.7",
        ]
    )
    fsdp = fsdp_config(config, model_dir=tmp_path)
    assert fsdp.loads_reference and fsdp.objective.kl_coef == 0.01 and fsdp.max_grad_norm is None
    assert (fsdp.lr_decay, fsdp.total_steps, fsdp.objective.temperature) == ("cosine", 7, 0.7)
    assert fsdp.model_path == str(tmp_path) and fsdp.objective.rollout_is_level is None
    assert fsdp.export_dtype == fsdp.precision  # engines get model.dtype, not fp32 masters


def test_sum_norm_aggregation_divides_by_the_response_limit_in_both_backends(tmp_path):
    """seq-mean-token-sum-norm needs its constant (packed batches have no padded width):
    the launcher hands both backends the response limit."""
    from rl_launcher.roles.backends import megatron_config

    config, _ = load_config(
        [
            "--algorithm.loss_agg_mode",
            "seq-mean-token-sum-norm",
            "--rollout.max_response_tokens",
            "48",
        ]
    )
    (tmp_path / "config.json").write_text("{}")  # rl-megatron checks that it is an HF dir
    assert fsdp_config(config, model_dir=tmp_path).objective.norm_length == 48.0
    assert megatron_config(config, model_dir=tmp_path).objective.norm_length == 48.0
    from rl_core.objective import Objective

    with pytest.raises(ValueError, match="needs norm_length"):
        Objective(loss_agg_mode="seq-mean-token-sum-norm")


def test_clock_splits_the_step():
    clock = Clock()
    clock.lap("rollout")
    clock.lap("train")
    times = clock.times()
    assert set(times) == {"time/rollout", "time/train", "time/step"}
    assert times["time/step"] >= times["time/rollout"] + times["time/train"]


def test_cpu_ranks_share_the_nodes_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert cpu_threads_env(1)["env_vars"] == {"OMP_NUM_THREADS": "8", "MKL_NUM_THREADS": "8"}
    assert cpu_threads_env(3)["env_vars"]["OMP_NUM_THREADS"] == "2"
    assert cpu_threads_env(16)["env_vars"]["OMP_NUM_THREADS"] == "1"  # never 0


def test_no_engine_restarts_while_engines_take_turns_or_share_a_weight_group(capsys):
    from types import SimpleNamespace

    from rl_launcher.roles.engine_pool import EnginePool

    engine = SimpleNamespace(health_interval_s=5.0)
    for sync, turns, why in (
        ("distributed", None, "weight-update group"),
        ("tensor", object(), "take turns"),
    ):
        pool = SimpleNamespace(config=SimpleNamespace(engine=engine), turns=turns, monitor=None)
        EnginePool.watch(pool, export=lambda path: True, transport=sync)
        assert pool.monitor is None
        assert why in capsys.readouterr().err


def test_an_engine_that_cannot_freeze_its_gc_is_reported_not_fatal():
    """engine_pool.freeze_gc, used after step 1 and after an engine restart: an engine
    without /freeze_gc (an older SGLang answers 404) gives a reason, not an exception."""
    import asyncio

    from rl_launcher.roles.engine_pool import freeze_gc
    from rl_sglang.client import EngineError

    class Engine:
        def __init__(self, answer):
            self.answer = answer

        async def freeze_gc(self):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    old = Engine(EngineError("http://127.0.0.1:1/freeze_gc", 404, "Not Found"))
    assert asyncio.run(freeze_gc(Engine("Garbage collection frozen.\n"))) == (
        "Garbage collection frozen."
    )
    reason = asyncio.run(freeze_gc(old))
    assert reason.startswith("not frozen:") and "404" in reason
