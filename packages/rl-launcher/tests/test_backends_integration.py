"""The loop with the other backends and transports, on CPU with real Ray, embedded engines
behind the real sglang-router: rl-megatron (TP=2 over two Ray actors, CPU shim) taking
turns with the engine as colocated GPUs do, and a disaggregated layout whose weights go
over a gloo weight-update group (the distributed transport). Both runs serve FP8 rollout
(engine.quantization=fp8): the engines must hold exactly the trainer's weights quantised."""

import json
from pathlib import Path

import pytest

from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.infra.colocation import Turns
from rl_launcher.loops.rl import run_step
from rl_launcher.session.start import start_run

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart" / "config.yaml"
LOGPROB_TOL = 1e-4
FP8_GAP = (1e-4, 0.05)  # mean |trainer - engine| log-prob with FP8 engines: seen, and small


def shrunk(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(QUICKSTART),
        "--num_steps",
        "2",
        "--rollout.batch_size",
        "4",
        "--rollout.group_size",
        "4",
        "--algorithm.entropy_coef",
        "0.1",
        "--optimizer.lr",
        "0.01",
        "--optimizer.schedule",
        "constant",
        "--logging.run_dir",
        str(run_dir),
        "--model.tokenizer_path",
        str(ROOT / "examples/quickstart/tokenizer"),
        "--data.train.0.path",
        str(ROOT / "examples/quickstart/data/train.jsonl"),
        *extra,
    ]


def two_steps(run) -> list[dict]:
    buffer = DataBuffer.from_config(run.config, num_ranks=run.num_ranks)
    return [run_step(run, buffer, step) for step in (1, 2)]


def check_weights_reached_the_engines(run, records, *, fp8: bool = False) -> None:
    assert run.rollout.engines.weight_versions() == ["2"]
    assert [r["sync/weight_version"] for r in records] == [1.0, 2.0]
    # step 2 sampled with step 1's weights, and its engine log-probs match the trainer's
    # (FP8 engines: within FP8's rounding, which shows)
    assert [r["rollout/weight_version_min"] for r in records] == [0.0, 1.0]
    if fp8:
        assert all(FP8_GAP[0] < r["mismatch/logprob_abs_diff_mean"] < FP8_GAP[1] for r in records)
    else:
        assert all(r["mismatch/logprob_abs_diff_max"] < LOGPROB_TOL for r in records)
    assert records[1]["sync/bytes"] > 0 and records[1]["train/grad_norm"] > 0
    assert all(0 < r["time/sync_call"] <= r["time/sync"] for r in records)
    assert all(0 < r["time/sync_export"] < r["time/sync_call"] for r in records)


def check_engine_serves_the_fp8_of_the_trainer(run, tmp_path) -> None:
    """The engine's log-probs equal, to float32 rounding, those of the trainer's current
    weights quantised and dequantised: the FP8 sync carried exactly those weights."""
    import torch

    from rl_sglang.fp8_checkpoint import load_fp8_model, write_fp8_checkpoint

    run.trainer.export_hf(str(tmp_path / "trained"))
    served = load_fp8_model(write_fp8_checkpoint(tmp_path / "trained", tmp_path / "fp8"))
    engines, prompt = run.rollout.engines, [3, 4, 5]
    params = {"max_new_tokens": 4, "ignore_eos": True}
    out = engines.call(
        engines.client(engines.urls[0]).generate(
            input_ids=prompt, return_logprob=True, sampling_params=params
        )
    )
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(served.eval()(ids).logits[0].float(), dim=-1)
    expected = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(expected, abs=LOGPROB_TOL)


def test_megatron_tp2_takes_turns_with_the_engine_and_syncs_weights(tmp_path):
    config, _ = load_config(
        shrunk(
            tmp_path / "run",
            "--backend.name",
            "megatron",
            "--backend.tensor_parallel",
            "2",
            "--cluster.devices_per_node",
            "2",
            "--megatron-sequence-parallel",
            "--engine.quantization",
            "fp8",
        )
    )
    run = start_run(config)
    try:
        # two ranks, one data-parallel rank: both TP ranks train on the same batch
        assert run.trainer.data_ranks == [0, 0] and run.num_ranks == 1
        engines = run.rollout.engines
        turns = engines.turns = run.trainer.turns = Turns(run.trainer, engines)
        records = two_steps(run)
        # FP8 rollout from rl-megatron's export, through kept tensor buffers
        check_weights_reached_the_engines(run, records, fp8=True)
        check_engine_serves_the_fp8_of_the_trainer(run, tmp_path)
    finally:
        run.close()
    train_then_sync = [
        "release weights+kv_cache+cuda_graph",
        "onload trainer",
        "resume weights+kv_cache+cuda_graph",
    ]
    generate = ["offload trainer"]
    assert turns.log == ["offload trainer", *train_then_sync, *generate, *train_then_sync]


def test_disaggregated_fp8_run_syncs_over_a_gloo_weight_update_group(tmp_path):
    """Also FP8 rollout (engine.quantization=fp8, with TIS): the engine starts from the
    converted checkpoint and every sync sends FP8 weights and their scales."""
    # one training bundle, one engine bundle; auto picks the distributed transport
    config, _ = load_config(
        shrunk(
            tmp_path / "run",
            "--cluster.colocate",
            "false",
            "--cluster.devices_per_node",
            "2",
            "--engine.quantization",
            "fp8",
            "--algorithm.rollout_is_level",
            "token",
        )
    )
    run = start_run(config)
    try:
        assert run.sync_options["transport"] == "distributed"
        assert run.plan.train_bundles == (0,) and run.plan.engine_bundles == ((1,),)
        records = two_steps(run)
        check_weights_reached_the_engines(run, records, fp8=True)
        check_engine_serves_the_fp8_of_the_trainer(run, tmp_path)
    finally:
        run.close()
    quant = json.loads((tmp_path / "run/initial_model_fp8/config.json").read_text())
    assert quant["quantization_config"]["weight_block_size"] == [128, 128]
    assert all(r["mismatch/weight_mean"] > 0 for r in records)  # TIS weighed the tokens
    # the quickstart model: 76,352 float32 parameters (305,408 bytes), of which the seven
    # projections of each of 2 layers hold 36,864 and go as 1 byte each, plus one 4-byte
    # scale per projection (each fits one 128x128 block)
    assert records[1]["sync/bytes"] == 305_408 - 2 * 36_864 * 3 + 2 * 7 * 4
    print("fp8 gap:", [r["mismatch/logprob_abs_diff_mean"] for r in records])
