"""Same seed, same machine, same config: same run. Two real ``rl-train`` runs (Ray, an
embedded engine behind the router, an rl-fsdp actor; the quickstart shrunk to one step of 16
samples) with a reward that fails on some responses under ``rollout.on_reward_error=skip``:
the same samples, rewards and losses; and every group trained on the samples that scored.
The second run names the built-in rollout as its ``rollout.rollout_function``: the path a
custom rollout takes gives the built-in's samples."""

from pathlib import Path

import pytest
from test_train_loop import shrunk

from rl_launcher.cli import main
from rl_launcher.data.buffer import reward_failed
from rl_launcher.infra.dumps import dump_files, read_rollout
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
# the clock's and the placement's, not the run's (and "time", the record's): timings,
# throughput, where each engine ran (its node and port), GPU utilisation
TIMES = ("time/", "perf/", "engine/", "gpu/")


BUILT_IN = "rl_launcher.roles.default_rollout:default_rollout"


def one_step(root: Path, name: str, *extra: str) -> tuple[dict, list[list]]:
    """Step 1's metrics record and rollout dump of a fresh run ``name``."""
    args = shrunk(
        root / name,
        "--num_steps",
        "1",
        "--checkpoint.interval",
        "0",
        "--rollout.reward",
        "failing_rewards:fails_on_low_digits",
        "--rollout.on_reward_error",
        "skip",
        "--rollout.dump_dir",
        str(root / f"{name}_dumps"),
        "--checkpoint.dir",
        str(root / f"{name}_ckpt"),
        *extra,
    )
    assert main(args) == 0
    (record,) = read_metrics(root / name)
    (dump,) = dump_files(root / f"{name}_dumps")
    return record, read_rollout(dump)


def test_same_seed_gives_the_same_step_and_failed_rewards_skip_samples(ray_cluster, tmp_path):
    first, groups = one_step(tmp_path, "a")
    second, groups_again = one_step(tmp_path, "b", "--rollout.rollout_function", BUILT_IN)
    samples = [s for g in groups for s in g]
    assert [(s.tokens, s.reward, s.rollout_log_probs) for s in samples] == [
        (s.tokens, s.reward, s.rollout_log_probs) for g in groups_again for s in g
    ]
    assert len({tuple(s.tokens[s.prompt_length :]) for s in samples}) > 2  # they were sampled
    kept = {k: v for k, v in first.items() if k != "time" and not k.startswith(TIMES)}
    assert kept == {k: v for k, v in second.items() if k != "time" and not k.startswith(TIMES)}
    assert "loss/pg" in kept and "rollout/reward/mean" in kept

    # a sample whose reward failed is left out, not its group: groups with two or more
    # scored samples train on those; the others are dropped and counted
    failed = [sum(map(reward_failed, g)) for g in groups]
    assert 0 < sum(failed) < 16 and any(0 < n <= 2 for n in failed), failed  # a partial group
    trained = sum(4 - n for n in failed if 4 - n >= 2)
    assert first["train/num_samples"] == trained
    assert first["rollout/groups_dropped_reward_error"] == sum(4 - n < 2 for n in failed)
    assert first["rollout/reward_errors"] == sum(failed)
