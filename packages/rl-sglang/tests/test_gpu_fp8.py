"""GPU only: FP8 rollout on real SGLang. A server started from the FP8 checkpoint rl-train
writes (rl_sglang.fp8_checkpoint) serves FP8 linear layers on its triton block kernels, its
log-probs are those of the dequantised weights, and FP8 weight updates (weights plus
weight_scale_inv, quantised on the GPU) by CUDA IPC and from disk replace them. Run on the
GPU machine: RL_SGLANG_PYTHONPATH=/tmp/sgsite pytest -m gpu."""

import asyncio

import pytest
import torch
from test_gpu_sglang import PROMPT, SHAPE, reference_logprobs
from test_gpu_sglang import SGLANG_ARGS as BF16_ARGS

from rl_core.fp8 import FP8_DTYPE, dequantize_named, quantize_named
from rl_sglang import transports
from rl_sglang.client import EngineClient
from rl_sglang.fp8_checkpoint import write_fp8_checkpoint
from rl_sglang.process import SGLangServer
from rl_sglang.tiny import random_model, save_tiny_model, tiny_config

pytestmark = pytest.mark.gpu
# test_gpu_sglang's SHAPE: every merged width a multiple of 128 (q 256, k/v 2 x 64,
# gate/up 512), as SGLang's FP8 layers need
# mean |engine - reference| log-prob of the sampled tokens, the reference a float32 forward
# of the dequantised weights: SGLang also rounds each activation to FP8 (per 128-group,
# activation_scheme dynamic) and computes in bf16. On CPU, that arithmetic on this random
# model (weights of std 0.2, sharply peaked outputs) gave 0.30-0.36 over three seeds, and
# 7.8-8.4 against another seed's weights; a bf16 engine alone gives ~0.1 (test_gpu_sglang)
NEAR = 0.75
SGLANG_ARGS = BF16_ARGS | {
    "quantization": "fp8",
    "fp8_gemm_backend": "triton",  # the bundle has no DeepGEMM; rl-train passes the same
}


def served_model(sent):
    """The model an FP8 engine computes with after loading ``sent`` (FP8 weights and their
    scales, other tensors as they are), dequantised to float32."""
    served = random_model(tiny_config(**SHAPE), seed=0).cuda()
    served.load_state_dict(dict(dequantize_named(sent, torch.float32)))
    return served.eval()


def sent_of(model, dtype=torch.float32):
    """``model``'s weights as FP8 sync sends them (the checkpoint writer quantises the
    saved float32 weights; rl-train's syncs the trainer's bf16 ones)."""
    return list(quantize_named((n, t.to(dtype)) for n, t in model.state_dict().items()))


def gap(url, model, version=None) -> float:
    async def go():
        async with EngineClient(url) as client:
            params = {"max_new_tokens": 16, "ignore_eos": True}
            return await client.generate(
                input_ids=PROMPT, return_logprob=True, sampling_params=params
            )

    out = asyncio.run(go())
    if version is not None:
        assert out["meta_info"]["weight_version"] == version
    got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    ref = reference_logprobs(model, PROMPT, out["output_ids"])
    return sum(abs(a - b) for a, b in zip(got, ref, strict=True)) / len(got)


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    source = save_tiny_model(root / "bf16", seed=0, **SHAPE)
    fp8_dir = write_fp8_checkpoint(source, root / "initial_model_fp8")
    server = SGLangServer(fp8_dir, sglang_args=SGLANG_ARGS, log_dir=root, ready_timeout_s=600)
    with server:
        yield server, sent_of(random_model(tiny_config(**SHAPE), seed=0).cuda())


def test_sglang_serves_the_fp8_checkpoint_on_triton_kernels(fp8_server):
    server, initial = fp8_server

    async def info():
        async with EngineClient(server.url) as client:
            return await client.server_info()

    served = asyncio.run(info())
    assert served["quantization"] == "fp8" and served["fp8_gemm_runner_backend"] == "triton"
    assert gap(server.url, served_model(initial)) < NEAR


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_fp8_weight_updates_replace_the_served_weights(fp8_server, transport, tmp_path):
    server, initial = fp8_server
    new = random_model(tiny_config(**SHAPE), seed=7 if transport == "tensor" else 8).cuda()
    named = sent_of(new, torch.bfloat16)
    assert any(t.dtype == FP8_DTYPE for _, t in named)
    version = f"fp8-{transport}"

    async def update():
        async with EngineClient(server.url) as client:
            if transport == "disk":
                return await transports.update_from_disk(
                    [client], named, tmp_path / "w", weight_version=version
                )
            buffer = transports.SendBuffer()  # as rl-train sends: a kept flattened buffer
            return await transports.update_from_tensor(
                [client], named, weight_version=version, buffer=buffer
            )

    assert asyncio.run(update())[0]["success"]
    near = gap(server.url, served_model(named), version)
    far = gap(server.url, served_model(initial), version)
    assert near < NEAR and far > 3 * near, (near, far)
