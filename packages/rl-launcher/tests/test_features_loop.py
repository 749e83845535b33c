"""The RL loop's optional features end to end on CPU (real Ray, embedded engine, router,
rl-fsdp): PPO with a critic (gae), rollout dumps, evaluation every N steps, TensorBoard,
the HF export; then a train-only run replaying the dumps, and ``rl-eval`` on the export."""

import json
from pathlib import Path

import pytest
from quickstart_config import PPO, QUICKSTART, write_config

from rl_launcher.cli import main
from rl_launcher.eval_cli import main as eval_main
from rl_launcher.eval_cli import resolve_model_dir
from rl_launcher.infra.dumps import ReplayRollout, dump_files, read_rollout
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
EVAL = {
    "datasets": [{"path": str(QUICKSTART / "data/train.jsonl"), "name": "additions"}],
    "samples_per_prompt": 2,
    "pass_k": [1, 2],
    "temperature": 1.0,
}


def config_file(directory: Path) -> Path:
    """The quickstart's PPO run with an entropy bonus and an eval set."""
    return write_config(directory, PPO, {"algorithm": {"entropy_coef": 0.1}, "eval": EVAL})


@pytest.fixture(scope="module")
def ppo_run(ray_cluster, tmp_path_factory):
    """Two PPO steps with a critic, dumping rollouts, evaluating before training and at step 2
    (sampled and greedy), TensorBoard on."""
    root = tmp_path_factory.mktemp("ppo")
    config = config_file(root)
    args = [
        "--config",
        str(config),
        "--num_steps",
        "2",
        "--logging.run_dir",
        str(root / "run"),
        "--rollout.dump_dir",
        str(root / "dumps"),
        "--eval.interval",
        "2",
        "--eval.at_start",
        "true",
        "--eval.greedy",
        "true",
        "--logging.tensorboard",
        "true",
        "--checkpoint.save_hf",
        "true",
    ]
    assert main(args) == 0
    return root


def test_ppo_trains_a_critic_and_checkpoints_it(ppo_run):
    records = read_metrics(ppo_run / "run")
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0: eval.at_start
    for record in records[1:]:
        assert record["loss/value"] > 0 and "critic/train/grad_norm" in record
        assert record["critic/returns_mean"] is not None and "loss/pg" in record
    step = ppo_run / "run/checkpoints/step_000002"
    assert (step / "critic").is_dir() and (step / "trainer").is_dir()
    assert (step / "hf/config.json").is_file()


def test_eval_runs_every_interval_and_is_charted(ppo_run):
    start, first, second = read_metrics(ppo_run / "run")
    assert not any(k.startswith("eval/") for k in first)
    for record in (start, second):
        assert 0.0 <= record["eval/additions/pass@1"] <= record["eval/additions/pass@2"] <= 1.0
        assert record["eval/additions/greedy@1"] in {i / 25 for i in range(26)}  # 25 prompts
    assert not any(k.startswith(("loss/", "rollout/")) for k in start)  # nothing trained yet
    assert second["eval/num_prompts"] == 25.0 and second["time/eval"] > 0
    assert (ppo_run / "run/plots/eval_pass_at_k.png").read_bytes()[:4] == b"\x89PNG"
    assert list((ppo_run / "run/tensorboard").glob("events.out.tfevents.*"))


def test_each_rollout_is_dumped_as_jsonl(ppo_run):
    files = dump_files(ppo_run / "dumps")
    assert [f.name for f in files] == ["rollout_000001.jsonl", "rollout_000002.jsonl"]
    groups = read_rollout(files[0])
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)
    sample = groups[0][0]
    assert sample.reward in (0.0, 1.0) and len(sample.rollout_log_probs) == 1
    assert not list((ppo_run / "dumps").glob("*.tmp"))


def test_replaying_the_dumps_trains_exactly_like_the_original_run(ppo_run):
    """Train-only replay: no engines; the same batches give the same losses."""
    config = config_file(ppo_run / "replay")
    args = [
        "--config",
        str(config),
        "--num_steps",
        "2",
        "--rollout.replay_dir",
        str(ppo_run / "dumps"),
        "--logging.run_dir",
        str(ppo_run / "replay/run"),
    ]
    assert main(args) == 0
    original, replayed = read_metrics(ppo_run / "run")[1:], read_metrics(ppo_run / "replay/run")
    for a, b in zip(original, replayed, strict=True):
        for key in ("loss/pg", "loss/value", "rollout/reward/mean", "critic/returns_mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert replayed[1]["replay/rollout_index"] == 2.0
    replay = ReplayRollout(ppo_run / "dumps", group_size=4)
    replay.rollout(4), replay.rollout(4)
    with pytest.raises(ValueError, match="has 2 rollouts and the run wants more"):
        replay.rollout(4)
    with pytest.raises(ValueError, match="group_size=2; replay with the dump's group size"):
        ReplayRollout(ppo_run / "dumps", group_size=2).rollout(4)


def test_rl_eval_evaluates_an_exported_checkpoint(ppo_run, capsys):
    config = config_file(ppo_run / "eval")
    out = ppo_run / "eval/summary.json"
    hf = ppo_run / "run/checkpoints/step_000002/hf"
    args = [
        "--config",
        str(config),
        "--model",
        str(hf),
        "--output",
        str(out),
        "--logging.run_dir",
        str(ppo_run / "eval/run"),
    ]
    assert eval_main(args) == 0
    summary = json.loads(out.read_text())
    assert summary == json.loads(capsys.readouterr().out)
    assert summary["model"] == str(hf)
    assert 0.0 <= summary["metrics"]["eval/additions/pass@1"] <= 1.0
    assert summary["datasets"] == {"additions": 25}
    # a run directory or a checkpoint resolves to (its newest checkpoint's) export
    assert resolve_model_dir(ppo_run / "run") == resolve_model_dir(hf.parent) == hf
    with pytest.raises(ValueError, match=r"checkpoint\.save_hf=true"):
        resolve_model_dir(ppo_run / "dumps")
    assert eval_main([*args[:3], str(ppo_run / "dumps"), *args[4:]]) == 2
