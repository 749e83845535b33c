"""Two gloo ranks on 127.0.0.1 (one spawn for the module): TP=2 and DP=2 equal TP=1."""

import math

import pytest
import tiny
import torch
from dist_job import LENGTHS, POLICY, SFT, critic_checks, rank_checks
from multi_rank import assert_same_step, one_rank_reference, spawn_gloo

from rl_core.logprobs import log_probs_and_entropy
from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def job(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("job") / "results.pt"
    dirs = {name: str(d) for name, (d, _) in model_dirs.items()}
    return spawn_gloo(rank_checks, 2, out, dirs, str(out))


@pytest.fixture(scope="module")
def reference(world1, model_dirs):
    """The same computations at TP=1 in this process, then one optimizer step."""
    return {
        name: one_rank_reference(model_dirs[name][0], train_step=True)
        for name in ("qwen2-tied", "qwen3", "qwen3-moe")
    }


TP2_VARIANTS = ["qwen2-tied", "qwen3", "qwen3+sp", "qwen3-moe+sp"]


@pytest.mark.parametrize("variant", TP2_VARIANTS)
def test_tp2_log_probs_equal_tp1_and_hf(job, reference, model_dirs, variant):
    name = variant.removesuffix("+sp")
    batch = tiny.random_batch(LENGTHS, seed=11)
    mask = batch.loss_mask.bool()
    got = job["tp2"][variant]["log_probs"]
    torch.testing.assert_close(got, reference[name]["log_probs"], atol=1e-5, rtol=0)
    hf = tiny.hf_log_probs(model_dirs[name][1], batch).detach()
    torch.testing.assert_close(got[mask], hf[mask], atol=2e-5, rtol=0)


@pytest.mark.parametrize("variant", TP2_VARIANTS)
def test_tp2_export_round_trip_is_exact(job, model_dirs, variant):
    original = tiny.hf_files(model_dirs[variant.removesuffix("+sp")][0])
    exported = job["tp2"][variant]["exported"]
    assert set(exported) == set(original)
    assert all(torch.equal(exported[n], original[n]) for n in original)


@pytest.mark.parametrize("variant", TP2_VARIANTS)
def test_tp2_loss_and_grads_equal_tp1(job, reference, variant):
    got, expected = job["tp2"][variant], reference[variant.removesuffix("+sp")]
    assert_same_step(got, expected)


@pytest.mark.parametrize("variant", TP2_VARIANTS)
def test_tp2_checkpoint_resumes(job, variant):
    assert job["tp2"][variant]["resumed_equal"]


def test_tp2_resume_from_a_distributed_checkpoint_equals_the_uninterrupted_run(job):
    got = job["reshard"]
    assert got["resumed_step"] == 1
    assert got["resumed_metrics"] == got["expected"]  # every metric, bit for bit
    assert torch.equal(got["resumed_log_probs"], got["log_probs"])


def test_tp2_checkpoint_resumes_at_tp1(job, world1, model_dirs):
    """megatron's distributed checkpoint reshards: TP=2's fused QKV, gate/up and vocab
    shards and its AdamW moments load into one rank, which then takes TP=2's second step."""
    got = job["reshard"]
    config = MegatronConfig(hf_path=model_dirs["qwen3"][0], **{**POLICY, "clip_grad": 1.0})
    backend = MegatronBackend(config)
    backend.load_checkpoint(got["ckpt"])
    assert backend.step == 1
    metrics = backend.train_step(tiny.random_batch(LENGTHS, seed=8))
    for key in ("loss/total", "loss/pg", "actor/entropy", "train/grad_norm"):
        assert metrics[key] == pytest.approx(got["expected"][key], abs=1e-5), key
    after = backend.compute_log_probs(tiny.random_batch(LENGTHS, seed=8))
    torch.testing.assert_close(after, got["log_probs"], atol=1e-5, rtol=0)
    fresh = MegatronBackend(config)  # the check can fail: one step moves the log-probs
    moved = fresh.compute_log_probs(tiny.random_batch(LENGTHS, seed=8)) - got["log_probs"]
    assert float(moved.abs().max()) > 1e-3


def test_vocab_parallel_equals_full_softmax(job):
    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(37, 64, generator=gen)
    targets, up_lp, up_ent = (
        torch.randint(0, 44, (37,), generator=gen),
        torch.randn(37, generator=gen),
        torch.randn(37, generator=gen),
    )
    real = logits[:, :44].clone().requires_grad_()
    lp, ent = log_probs_and_entropy(real, targets, temperature=0.7)
    ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
    got = job["vocab_parallel"]
    torch.testing.assert_close(got["log_probs"], lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["entropy"], ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["grad"][:, :44], real.grad, atol=1e-5, rtol=1e-4)
    assert torch.equal(got["grad"][:, 44:], torch.zeros(37, 20))  # padding columns


def test_dp2_sums_to_the_full_batch(job, reference):
    got, expected = job["dp2"], reference["qwen3"]
    assert got["metrics"]["loss/total"] == pytest.approx(
        expected["metrics"]["loss/total"], abs=1e-5
    )
    for hf_name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][hf_name], grad, atol=1e-5, rtol=1e-4, msg=hf_name)


def test_dp2_zero_optimizer_step_equals_full_adamw(job, reference, world1):
    got, expected = job["dp2"], reference["qwen3"]
    assert 0 < got["zero_shards"] < len(expected["grads"])  # each rank holds part of the state
    torch.testing.assert_close(
        got["log_probs_after_step"], expected["log_probs_after_step"], atol=1e-5, rtol=0
    )
    assert got["resumed_equal"]


def test_ep2_equals_one_rank(job, reference, model_dirs):
    got, expected = job["ep2"], reference["qwen3-moe"]
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    original = tiny.hf_files(model_dirs["qwen3-moe"][0])
    assert set(got["exported"]) == set(original)
    assert all(torch.equal(got["exported"][n], original[n]) for n in original)
    assert_same_step(got, expected, metrics=("loss/total",))
    assert got["resumed_equal"]  # experts split over EP ranks, from a distributed checkpoint


@pytest.mark.parametrize("variant", ["cp2", "cp2_compiled"])
def test_cp2_equals_one_rank(job, reference, variant):
    got, expected = job[variant], reference["qwen3"]
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    assert_same_step(got, expected)
    whole = 2 if variant == "cp2_compiled" else 0
    assert got["compiled_layers"].get("whole_layers", 0) == whole


def test_cp2_with_ep2_equals_one_rank(job, reference, model_dirs):
    """CP=2 x EP=2 on two ranks (the EP group is the CP group): each rank runs its zigzag
    half of every row and half the experts, which get both halves' tokens; two
    micro-batches, export, resume."""
    got, expected = job["cp2_ep2"], reference["qwen3-moe"]
    assert got["micro_batches"] == 2
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    assert_same_step(got, expected)
    original = tiny.hf_files(model_dirs["qwen3-moe"][0])
    assert set(got["exported"]) == set(original)
    assert all(torch.equal(got["exported"][n], original[n]) for n in original)
    assert got["reloaded_equal"] and got["resumed_equal"]


def test_tp2_sequence_parallel_critic_equals_tp1(job, world1, model_dirs):
    expected = critic_checks(str(model_dirs["qwen3"][0]))
    assert expected["values"].abs().max() > 0.01  # the step moved the zero-initialised head
    got = job["critic_tp2_sp"]
    for key in ("values", "values_after_two"):
        torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-4)


def test_pp2_critic_equals_one_rank_and_resumes(job, world1, model_dirs):
    """Value head on the last stage (of a tied model: the critic unties it), value loss
    through 1F1B over two micro-batches: the same losses and values as one rank after two
    steps (the second one moves the layers of both stages)."""
    expected = critic_checks(str(model_dirs["qwen2-tied"][0]))
    got = job["critic_pp2"]
    assert got["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert (expected["values_after_two"] - expected["values"]).abs().max() > 1e-3
    for key in ("values", "values_after_two"):
        torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-4)
    assert got["resumed_equal"]


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3", "qwen3+compiled"])
def test_pp2_equals_one_rank(job, reference, model_dirs, name):
    got, expected = job["pp2"][name], reference[name.removesuffix("+compiled")]
    name = name.removesuffix("+compiled")
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    original = tiny.hf_files(model_dirs[name][0])
    assert set(got["exported"]) == set(original)
    assert all(torch.equal(got["exported"][n], original[n]) for n in original)
    assert_same_step(got, expected)
    torch.testing.assert_close(
        got["log_probs_after_step"], expected["log_probs_after_step"], atol=1e-5, rtol=0
    )


def test_pp2_compiled_layers_run_as_one_graph_each(job):
    """Each stage's layer compiled whole (the eager reference above: same log-probs, loss
    and gradients), with no graph break over the two micro-batch shapes."""
    got = job["pp2"]["qwen3+compiled"]
    assert got["compiled_layers"] == {"whole_layers": 1, "norms_only_layers": 0}
    assert got["compile"]["graph_breaks"] == 0, got["compile"]["break_reasons"]
    assert not got["compile"]["failures"]
    assert not job["pp2"]["qwen3"]["compiled_layers"]  # off by default on CPU


def test_pp2_one_forward_one_backward_equals_gpipe_and_the_unsplit_model(job, reference):
    got, expected = job["pp2_schedules"], reference["qwen3"]  # expected: one micro-batch
    for schedule in ("1f1b", "gpipe"):
        for key in ("loss/total", "loss/pg", "actor/entropy", "pg/clipfrac"):
            value = got[schedule]["metrics"][key]
            assert value == pytest.approx(expected["metrics"][key], abs=1e-5), (schedule, key)
            assert value == pytest.approx(got["gpipe"]["metrics"][key], abs=1e-6), (schedule, key)
        for hf_name, grad in expected["grads"].items():
            ours = got[schedule]["grads"][hf_name]
            torch.testing.assert_close(ours, grad, atol=1e-5, rtol=1e-4, msg=hf_name)
            torch.testing.assert_close(ours, got["gpipe"]["grads"][hf_name], atol=1e-6, rtol=1e-5)


def test_pp2_tied_resume_from_a_distributed_checkpoint(job):
    assert job["pp2_resume"]


def test_pp2_one_forward_one_backward_holds_at_most_pp_micro_batches(job):
    """Four micro-batches: GPipe keeps all four on both stages; 1F1B keeps at most
    pp - stage (stage 0: one warm-up forward + the current one; the last stage: one)."""
    assert job["pp2_schedules"]["gpipe"]["peak"] == [4, 4]
    assert job["pp2_schedules"]["1f1b"]["peak"] == [2, 1]


@pytest.mark.parametrize("layout", ["tp2+sp", "pp2", "dp2"])
def test_bf16_layouts_match_fp32_one_rank(job, world1, model_dirs, layout):
    """bf16 params with fp32 main grads: the TP=2 + SP backward (bf16 reduce-scatter), PP=2
    (bf16 activations sent between stages) and ZeRO-1 on fp32 masters run and stay within
    bf16 tolerances of the fp32 one-rank model; training lowers the loss."""
    got = job["bf16"][layout]
    config = MegatronConfig(hf_path=model_dirs["qwen3"][0], objective=SFT, device="cpu")
    fp32 = MegatronBackend(config)
    full = tiny.random_batch(LENGTHS, seed=11).with_global_denominators()
    part = full.select([0, 2]) if layout == "dp2" else full  # dp2: rank 0's half
    mask = part.loss_mask.bool()
    diff = (got["log_probs"] - fp32.compute_log_probs(part))[mask].abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.15, (diff.mean(), diff.max())
    fp32.forward_backward(full)  # dp2: the gradient summed over both ranks' halves
    expected = fp32.hf_gradients()
    error = torch.stack([(got["grads"][n] - g).norm() for n, g in expected.items()]).norm()
    assert float(error) < 0.05 * float(torch.stack([g.norm() for g in expected.values()]).norm())
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dp2_nonfinite_steps_are_skipped_by_both_ranks_and_leave_state_untouched(job, precision):
    got = job["nonfinite_dp2"][precision]  # NaN on rank 1 only, then inf on rank 0 only
    assert [m["train/nonfinite_skipped"] for m in got["bad"]] == [1.0, 1.0]
    assert not any(math.isfinite(m["train/grad_norm"]) for m in got["bad"])
    assert math.isnan(got["bad"][0]["loss/total"])
    assert got["untouched"]  # weights, fp32 masters, ZeRO-1 AdamW shard, step


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dp2_good_step_after_skips_equals_the_run_without_them(job, precision):
    got = job["nonfinite_dp2"][precision]
    assert got["same_as_reference"]
    assert got["good"][1]["train/nonfinite_skipped"] == 0.0
    assert got["good"][1]["loss/total"] == got["expected"][1]["loss/total"]


def test_pp2_with_two_virtual_stages_equals_one_rank(job, world1, model_dirs):
    """Interleaved 1F1B over two model chunks per stage: loss, gradients, grad norm and
    log-probs of the unsplit four-layer model; export and checkpoints as without chunks."""
    got = job["vpp2"]
    assert got["layers"] == [[1], [3]]  # rank 0's chunks: global layers 1 and 3 (1-based)
    assert got["micro_batches"] == 3  # run as four: the interleaved schedule needs a multiple of pp
    path = model_dirs["qwen3-4layers"][0]
    expected = one_rank_reference(path)
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    assert_same_step(got, expected)
    original = tiny.hf_files(path)
    assert set(got["exported"]) == set(original)
    assert all(torch.equal(got["exported"][n], original[n]) for n in original)
    assert got["reloaded_equal"] and got["resumed_equal"] and got["loads_without_vpp"]
    compiled = job["vpp2_compiled"]  # each chunk's layer as one graph: the same step
    assert compiled["compiled_layers"] == {"whole_layers": 2, "norms_only_layers": 0}
    torch.testing.assert_close(compiled["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    assert_same_step(compiled, expected)
