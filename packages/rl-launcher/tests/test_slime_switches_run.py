"""slime's algorithm switches end to end on CPU (real Ray, embedded engine, router,
rl-fsdp): one four-step quickstart run with old log-probs from the rollout, unbiased KL,
OPSM, a reference refreshed every two steps, whitened GRPO advantages, the embeddings
frozen, the log-prob gap gate and train-batch dumps on; each effect is read back from
metrics.jsonl, the dumps and the exported weights. A copy of the run is resumed from its
step-3 checkpoint (not a multiple of the refresh interval) and redoes step 4 with the
uninterrupted run's reference."""

import shutil
from pathlib import Path

import pytest
import torch
from quickstart_config import LOW_DIGIT, write_config
from safetensors.torch import load_file

from rl_launcher.cli import main
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
SWITCHES = {
    "algorithm": {
        "old_log_probs": "rollout",
        "kl_coef": 0.05,
        "kl_kind": "k3",
        "unbiased_kl": True,
        "opsm": True,
        "opsm_delta": 0.0,
        "ref_update_interval": 2,
        "normalize_advantages": True,
        "max_logprob_gap": 0.5,
    },
    "model": {"freeze": ["embed_tokens"]},
    "logging": {"dump_train_batch": True},
    "rollout": {"batch_size": 4, "group_size": 4, "reward": LOW_DIGIT},
    "checkpoint": {"save_hf": True},
}


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in directory.glob("*.safetensors"):
        tensors |= load_file(str(path))
    return tensors


@pytest.fixture(scope="module")
def run_dir(ray_cluster, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("switches")
    args = ["--config", str(write_config(root, SWITCHES)), "--num_steps", "4"]
    assert main([*args, "--logging.run_dir", str(root / "run"), "--checkpoint.interval", "3"]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def resumed_dir(run_dir) -> Path:
    """The run copied and ``--resume``d from its step-3 checkpoint: step 4 again."""
    resumed = run_dir.parent / "resumed"
    shutil.copytree(run_dir, resumed)
    (resumed / "train_batches/step_000004.pt").unlink()
    args = ["--config", str(run_dir.parent / "config.yaml"), "--num_steps", "4", "--resume", "3"]
    assert main([*args, "--logging.run_dir", str(resumed)]) == 0
    return resumed


def step_batch(run_dir: Path, step: int) -> dict:
    (batch,) = torch.load(run_dir / f"train_batches/step_{step:06d}.pt")["rank_batches"]
    return batch


def test_every_switch_shows_in_the_metrics(run_dir):
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        # rollout old log-probs: no driver-side recompute, the train step measures the gap
        assert 0.0 <= record["mismatch/logprob_abs_diff_mean"] <= 0.5  # under the gate
        assert "mismatch/logprob_abs_diff_max" not in record
        # OPSM on; the metric is the last minibatch's (4 samples here), which can be all
        # masked
        assert 0.0 <= record["pg/opsm_frac"] <= 1.0
        assert record["loss/kl"] >= 0.0  # the (unbiased) KL term is in the loss
    assert sum(r["pg/opsm_frac"] for r in records) > 0  # some sequences were masked
    assert [r.get("actor/ref_updated") for r in records] == [None, 1.0, None, 1.0]
    assert 0 < records[0]["rollout/reward/mean"] < 1


def reference_gap(batch: dict) -> float:
    """How far the reference's log-probs are from the engine's (the policy it sampled with)."""
    mask = batch["loss_mask"] > 0
    return float((batch["ref_log_probs"] - batch["rollout_log_probs"])[mask].abs().max())


def test_the_reference_is_the_policy_after_each_refresh(run_dir):
    """The engines sample step s with the policy after step s - 1; the reference is the
    initial policy until it is refreshed after step 2: so its log-probs match the engine's
    at steps 1 and 3 and not at steps 2 and 4."""
    gaps = [reference_gap(step_batch(run_dir, step)) for step in (1, 2, 3, 4)]
    assert gaps[0] < 1e-4 and gaps[2] < 1e-4 and gaps[1] > 1e-3 and gaps[3] > 1e-3, gaps


def test_a_resume_between_refreshes_keeps_the_refreshed_reference(run_dir, resumed_dir):
    """Resumed at step 3 (the reference: the policy after step 2, saved in the checkpoint),
    step 4 samples the same responses and its reference log-probs, hence its KL, are the
    uninterrupted run's (the resumed policy as reference would match the engine's)."""
    uninterrupted, resumed = step_batch(run_dir, 4), step_batch(resumed_dir, 4)
    assert torch.equal(resumed["tokens"], uninterrupted["tokens"])
    torch.testing.assert_close(
        resumed["ref_log_probs"], uninterrupted["ref_log_probs"], atol=1e-6, rtol=0
    )
    assert reference_gap(resumed) > 1e-3
    (record,) = [r for r in read_metrics(resumed_dir) if r["step"] == 4]
    (before,) = [r for r in read_metrics(run_dir) if r["step"] == 4]
    assert record["loss/kl"] == pytest.approx(before["loss/kl"], abs=1e-6)


def test_train_batches_are_dumped_with_rollout_old_log_probs_and_whitened_advantages(run_dir):
    files = sorted((run_dir / "train_batches").glob("step_*.pt"))
    assert [f.name for f in files] == [f"step_00000{i}.pt" for i in (1, 2, 3, 4)]
    (batch,) = torch.load(files[0])["rank_batches"]  # one data-parallel rank
    mask = batch["loss_mask"] > 0
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    advantages = batch["advantages"][mask]
    assert float(advantages.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(advantages.std()) == pytest.approx(1.0, abs=1e-3)
    assert batch["ref_log_probs"] is not None and batch["global_num_tokens"] == mask.sum()


def test_frozen_embeddings_are_exported_unchanged(run_dir):
    start = hf_weights(run_dir / "initial_model")
    end = hf_weights(run_dir / "checkpoints/step_000004/hf")
    assert torch.equal(end["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert not torch.equal(end["lm_head.weight"], start["lm_head.weight"])
