"""rl_fsdp.profiling: the step summary by hand (overlapping kernels counted once in the
busy time, totals per name and category), kernel names of a real H100/H200 trace sorted
into their categories, one real profiled training step on CPU, the counting of
sync-debug warnings by call site, and the attribution of copy kernels to operators and
source lines (the grouping by hand, the launching operator and call site read from a real
CPU profile, backward operators traced to their forward line)."""

import warnings

import pytest
import torch
from fsdp_tiny import CONFIGS, tokens_batch

from rl_fsdp.profiling import (
    CopyLaunch,
    call_site,
    category,
    copy_kind,
    copy_report,
    copy_sources,
    count_sync_warnings,
    forward_operators,
    host_profile,
    launch_origin,
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


def test_copy_sources_skip_without_cuda():
    ran = []
    report = copy_sources(lambda: ran.append(1), torch.device("cpu"))
    assert report["total_ms"] == 0.0 and report["top"] == [] and "skipped" in report
    assert not ran


BF16_CAST = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda"
    "(at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, "
    "at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1})"
)


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl AllGather"),
        ("Memcpy DtoH (Device -> Pageable)", "Memcpy DtoH (Device -> Pageable)"),
        ("Memset (Device)", "Memset (Device)"),
        (BF16_CAST, "bfloat16_copy_kernel_cuda(float)"),
        (
            "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda"
            "(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}>",
            "direct_copy_kernel_cuda(float)",
        ),
        (
            "void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float>",
            "chunk_cat_cuda_kernel",
        ),
    ],
)
def test_copy_kinds(kernel, kind):
    assert copy_kind(kernel) == kind


# Stacks as the profiler names frames, outermost first.
BENCH = "train_megatron.py(217): <lambda>"
LAYER = "megatron/core/transformer/transformer_layer.py(300): forward"
CAST = "rl_megatron/backend.py(88): cast_params"
MODULE = "torch/nn/modules/module.py(1791): _call_impl"
ITEM = "rl_core/objective.py(40): metrics"


def test_copy_report_groups_launches_by_kind_operator_and_call_site():
    launches = [
        CopyLaunch("aten::to > aten::copy_", (BENCH, MODULE, LAYER, MODULE, CAST), BF16_CAST, 300),
        CopyLaunch("aten::to > aten::copy_", (BENCH, MODULE, LAYER, MODULE, CAST), BF16_CAST, 500),
        CopyLaunch("aten::copy_", (BENCH, MODULE, LAYER, MODULE, CAST), BF16_CAST, 100),  # other op
        CopyLaunch("aten::item", (BENCH, ITEM), "Memcpy DtoH (Device -> Pageable)", 2500),
        CopyLaunch("c10d::allreduce_", (BENCH, LAYER), "ncclDevKernel_AllReduce_Sum_bf16", 700),
    ]
    report = copy_report(launches, device_us=4600.0, top=10, frames=2)
    assert report["total_ms"] == 4.6 and report["copy_ms"] == 3.4 and report["nccl_ms"] == 0.7
    assert report["unattributed_ms"] == pytest.approx(0.5)
    top = report["top"]
    assert [(e["ms"], e["count"], e["max_ms"], e["op"]) for e in top] == [
        (2.5, 1, 2.5, "aten::item"),
        (0.8, 2, 0.5, "aten::to > aten::copy_"),
        (0.1, 1, 0.1, "aten::copy_"),
    ]
    # megatron and this project's frames, not the bench's or torch's; innermost last
    cast_site = "megatron/core/transformer/transformer_layer.py:300 forward > "
    cast_site += "rl_megatron/backend.py:88 cast_params"
    assert top[1]["where"] == cast_site and top[1]["kernel"] == "bfloat16_copy_kernel_cuda(float)"
    assert [e["kernel"] for e in report["nccl"]] == ["nccl AllReduce"]
    host_device = report["host_device"]  # the DtoH memcpy alone, with a longer stack
    assert [(e["ms"], e["op"]) for e in host_device] == [(2.5, "aten::item")]
    assert host_device[0]["where"] == "rl_core/objective.py:40 metrics"  # own code only


def test_call_site_keeps_the_innermost_own_frame_and_names_the_library_below():
    fsdp = "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py(120): foreach_all_gather"
    stack = (BENCH, LAYER, "transformers/models/qwen2/modeling_qwen2.py(50): forward", CAST)
    stack += ("my_hooks.py(7): pre_forward", MODULE, fsdp)
    where = call_site(stack, 2)
    assert where == (
        "rl_megatron/backend.py:88 cast_params > my_hooks.py:7 pre_forward"
        " [in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:120 foreach_all_gather]"
    )
    assert call_site((MODULE,), 3) == "torch/nn/modules/module.py:1791 _call_impl"
    assert call_site(("<built-in method to>",), 3) == "(no Python frames)"
    stdlib = "/usr/lib/python3.11/contextlib.py(141): __exit__"
    assert call_site((ITEM, "contextlib.py(141): __exit__", stdlib), 3).startswith(
        "rl_core/objective.py:40 metrics ["
    )


def _cast_twice(x):
    return x.to(torch.float64).float()


def test_launching_operator_and_call_site_from_a_real_cpu_profile():
    """On CPU the copies have no kernels; the operators' origins are what copy_sources
    reads on CUDA, and a backward copy is traced to the line of its forward cast."""
    from torch.profiler import ProfilerActivity, profile

    linear = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True) as prof:
        linear(_cast_twice(x)).sum().backward()
    events = prof.events()
    forward_ops = forward_operators(events)
    origins = [launch_origin(e, forward_ops) for e in events if e.name == "aten::copy_"]
    casts = {op: call_site(stack, 2) for op, stack in origins if "_to_copy" in op}
    cast_line = _cast_twice.__code__.co_firstlineno  # Python events name a function by its def
    assert casts["aten::to > aten::_to_copy > aten::copy_[double, float]"].endswith(
        f"test_fsdp_profiling.py:{cast_line} _cast_twice"
    )
    backward = [op for op in casts if op.startswith("ToCopyBackward0 > ")]
    assert len(backward) == 2 and all(casts[op].endswith(" _cast_twice") for op in backward)
