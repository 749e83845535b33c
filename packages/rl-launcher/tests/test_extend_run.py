"""examples/extend/config.yaml through rl-train on CPU, in one run: a prompt source class,
a generate function that fans out, a group reward, a sample filter, a post-process, a
rollout log function and dotted-path algorithms (advantage estimator and group filter from
the example; a policy loss and reducer from PYTHONPATH that leave marks no built-in can,
so the FSDP ranks are seen to train with them)."""

import json
from pathlib import Path

import pytest
from test_train_loop import ROOT

from rl_core.types import Sample
from rl_launcher.cli import main
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, ray_cluster):
    run_dir = tmp_path_factory.mktemp("extend") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(TESTS))  # where extend_user_loss lives; the ranks get it too
    mp.chdir(ROOT)  # the config's relative tokenizer path
    try:
        args = [
            "--config",
            str(ROOT / "examples/extend/config.yaml"),
            "--num_steps=2",
            f"--logging.run_dir={run_dir}",
            f"--rollout.dump_dir={run_dir / 'dumps'}",
            "--algorithm.policy_loss=extend_user_loss:all_clipped_pg",
            "--algorithm.loss_agg_mode=extend_user_loss:hundredfold_token_mean",
        ]
        assert main(args) == 0
    finally:
        mp.undo()
    return run_dir


def dumped_groups(run_dir: Path, step: int) -> list[list[Sample]]:
    samples = [
        Sample.from_json(line)
        for line in (run_dir / "dumps" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
    ]
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())


def test_every_step_trains_post_processed_fanned_out_groups(run_dir):
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        groups = dumped_groups(run_dir, record["step"])
        assert len(groups) == 8  # rollout.batch_size prompts from the source class
        sizes = [len(g) for g in groups]
        # fan-out: 4 samples x 2 answers = 8; the filter takes empty ones; post_process keeps 6
        assert all(0 < size <= 6 for size in sizes)
        assert record["extend/group_size_mean"] == pytest.approx(sum(sizes) / len(sizes))
        # a group short of 6 lost the rest to the filter; the filter took no more than is gone
        lost_to_filter = sum(8 - size for size in sizes if size < 6)
        assert lost_to_filter <= record["rollout/samples_filtered"] <= 8 * 8 - sum(sizes)
        for group in groups:
            for sample in group:
                assert sample.response.strip()  # the filter's refusals never train
                assert sample.metadata["a"] + sample.metadata["b"] == int(sample.label)


def test_the_group_reward_scored_every_sample(run_dir):
    for step in (1, 2):
        for group in dumped_groups(run_dir, step):
            rewards = [s.reward for s in group]
            assert set(rewards) <= {0.0, 1.0, 1.5}
            correct = [s.response.strip() == s.label for s in group]
            assert [r > 0 for r in rewards] == correct


def test_the_ranks_trained_with_the_dotted_loss_and_reducer(run_dir):
    for record in read_metrics(run_dir):
        assert record["pg/clipfrac"] == pytest.approx(1.0)  # every token, as the loss says
        # actor/entropy is aggregated by the reducer: 100 x a per-token entropy (> 0.1 nat)
        assert record["actor/entropy"] > 10.0


def test_the_sources_position_is_in_the_checkpoint(run_dir):
    (state_file,) = (run_dir / "checkpoints").glob("*/state.json")
    data = json.loads(state_file.read_text())["data"]
    assert data["source"] == "addition_hooks:AdditionSource"
    assert data["inner"] == {"drawn": data["num_drawn"]} and data["num_drawn"] >= 16
