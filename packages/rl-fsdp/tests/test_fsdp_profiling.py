"""rl_fsdp.profiling: the step summary by hand (overlapping kernels counted once in the
busy time, totals per name and category), kernel names of a real H100/H200 trace sorted
into their categories, one real profiled training step on CPU, and the counting of
sync-debug warnings by call site."""

import warnings

import pytest
import torch
from fsdp_tiny import CONFIGS, tokens_batch

from rl_fsdp.profiling import (
    category,
    count_sync_warnings,
    host_profile,
    profile_step,
    summarize,
    sync_points,
    sync_report,
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, cutlass::bf16>>",
            "attention",
        ),
        (
            "void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<cutlass::bfloat16_t>",
            "attention",
        ),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl+copy"),
        ("Memcpy HtoD (Pageable -> Device)", "nccl+copy"),
        ("void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float>", "nccl+copy"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise+norm"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>",
            "elementwise+norm",
        ),
        ("void cub::DeviceRadixSortOnesweepKernel<int>", "other"),
    ],
)
def test_kernel_categories(name, expected):
    assert category(name) == expected


def test_summary_by_hand():
    kernels = [
        ("gemm_a", 0.0, 400.0, 400.0),
        ("gemm_a", 300.0, 500.0, 200.0),  # overlaps the first: busy 0..500 once
        ("flash_fwd", 600.0, 700.0, 100.0),
        ("ncclDevKernel_AllGather", 900.0, 990.0, 90.0),
        ("mystery", 1000.0, 1000.0, 0.0),  # empty interval
    ]
    report = summarize(kernels, 2000.0, top=2, device="cuda")
    assert report["busy_ms"] == pytest.approx(0.69)  # 500 + 100 + 90 us
    assert report["busy_fraction"] == pytest.approx(0.345)
    assert report["kernel_ms"] == pytest.approx(0.79) and report["kernel_count"] == 5
    assert report["categories_ms"] == {
        "attention": 0.1,
        "nccl+copy": 0.09,
        "gemm": 0.6,
        "optimizer": 0.0,
        "elementwise+norm": 0.0,
        "other": 0.0,
    }
    gaps = report["idle_gaps"]  # 500..600 and 700..900 (the empty interval is no kernel)
    assert gaps["count"] == 2 and gaps["total_ms"] == pytest.approx(0.3)
    assert gaps["largest"][0] == {
        "ms": 0.2,
        "after": "flash_fwd",
        "before": "ncclDevKernel_AllGather",
    }
    top = report["top_kernels"]
    assert [(k["name"], k["count"], k["total_ms"]) for k in top] == [
        ("gemm_a", 2, 0.6),
        ("flash_fwd", 1, 0.1),
    ]


def test_profile_of_a_real_cpu_training_step():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed
    from rl_core.objective import Objective
    from rl_fsdp import FSDPBackend, FSDPConfig

    info = init_distributed(device="cpu")
    try:
        objective = Objective(mode="sft")
        config = FSDPConfig(model_config=CONFIGS["qwen2"], device="cpu", objective=objective)
        backend = FSDPBackend(config, dist_info=info)
        batch = tokens_batch().with_global_denominators()
        report = profile_step(lambda: backend.train_step(batch), torch.device("cpu"), top=5)
        host = host_profile(lambda: backend.train_step(batch), torch.device("cpu"), top=50)
    finally:
        dist.destroy_process_group()
    assert 0.0 < report["busy_fraction"] <= 1.0 and report["step_ms"] > 0
    totals = [k["total_ms"] for k in report["top_kernels"]]
    assert len(totals) == 5 and totals == sorted(totals, reverse=True)
    assert report["categories_ms"]["gemm"] > 0 and report["categories_ms"]["attention"] > 0
    assert sum(report["categories_ms"].values()) == pytest.approx(report["kernel_ms"], rel=1e-2)
    own = [f["own_ms"] for f in host["functions"]]
    assert len(own) == 50 and own == sorted(own, reverse=True)
    assert 0 < sum(own) <= host["profiled_ms"] + 1e-6 and host["step_ms"] > 0
    # the step's own code and FSDP's hooks are in the profile, named by package path
    assert any("rl_fsdp/" in f["where"] for f in host["functions"]) or any(
        "torch/distributed/fsdp" in f["where"] for f in host["functions"]
    )


def _waits_for_device():
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_sync_warnings_are_counted_by_call_site_and_others_still_shown():
    with pytest.warns(UserWarning, match="unrelated"), count_sync_warnings(frames=2) as counts:
        for _ in range(3):
            _waits_for_device()
        _waits_for_device()
        warnings.warn("unrelated", UserWarning, stacklevel=1)
    report = sync_report(counts, top=5)
    assert report["total"] == 4
    assert [entry["count"] for entry in report["top"]] == [3, 1]
    first = report["top"][0]["where"]
    assert first.count(" > ") == 1 and first.endswith("_waits_for_device")
    assert "test_sync_warnings_are_counted" in first


def test_sync_points_skip_without_cuda():
    ran = []
    report = sync_points(lambda: ran.append(1), torch.device("cpu"))
    assert report["total"] == 0 and "skipped" in report and not ran
