"""Weight sync from a trainer process into a serving engine: seconds per GB of bf16 weights,
each next to its bound measured in the same run; prints and writes one JSON object.

    python bench/weight_sync.py --engines sglang,embedded --out result.json      # 1 GPU
    python bench/weight_sync.py --engines sglang,embedded --disaggregated ...    # 2 GPUs

Colocated (engine on the trainer's GPU): ``/update_weights_from_tensor`` with CUDA IPC
handles, as a list of (name, tensor) (one handle per tensor) or as one flattened uint8
bucket (one handle, metadata alongside), in one bucket or in buckets of ``--bucket-mb``.
Bound: a device-to-device copy of the same bytes (one flat ``copy_``).

Disaggregated (engine on GPU 1, trainer on GPU 0): ``/update_weights_from_distributed``
over an NCCL group between the trainer and the engine, one broadcast per tensor or one per
flattened bucket. Bound: an NCCL broadcast of the same bytes between the two GPUs in a
separate two-process group.

Each figure is the median of ``--repeats`` full syncs of the whole model after one warm-up;
a sync ends when every engine answered (weights applied, version bumped).
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import SHAPES
from report import write_report

from rl_core.weights import bucket_by_bytes
from rl_sglang import transports
from rl_sglang.client import EngineClient
from rl_sglang.process import EmbeddedEngine, SGLangServer, free_port
from rl_sglang.tiny import byte_tokenizer, random_model, tiny_config

SGLANG_ARGS = {
    "dtype": "bfloat16",
    "mem_fraction_static": 0.3,
    "skip_tokenizer_init": True,
    "disable_cuda_graph": True,
    # the kernels every SGLang build has (the GPU machine's bundle leaves out FA3/FlashInfer)
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
}
GB = 1e9


def save_model(shape: str, path: Path, seed: int) -> Path:
    config = tiny_config(**SHAPES[shape], max_position_embeddings=4096)
    random_model(config, seed=seed, dtype=torch.bfloat16).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def trainer_weights(shape: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's side: unique bf16 tensors on cuda:0 (a tied lm_head is sent once)."""
    model = random_model(tiny_config(**SHAPES[shape]), seed=seed, dtype=torch.bfloat16)
    seen, named = set(), []
    for name, tensor in model.to("cuda:0").state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            named.append((name, tensor))
    return named


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def cuda_timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` with the device synchronised around it (after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bound(named, repeats: int) -> float:
    src = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
    dst = torch.empty_like(src)
    return cuda_timed(lambda: dst.copy_(src), repeats)


def buckets(named, bucket_mb: int | None):
    if bucket_mb is None:
        return [named]
    return list(bucket_by_bytes(named, bucket_bytes=bucket_mb * 2**20))


async def time_formats(named, repeats: int, bucket_mb: int, send, list_name: str) -> dict:
    """s/GB of whole-model syncs for each format (per tensor or flattened) and bucket size
    (one bucket or ``bucket_mb``); ``await send(bucket, flatten, version)`` carries one
    bucket and raises when the engine did not apply it."""
    size, results = nbytes(named), {}
    for flatten in (False, True):
        for mb in (None, bucket_mb):
            parts, times = buckets(named, mb), []
            for rep in range(repeats + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for part in parts:
                    await send(part, flatten, f"{int(flatten)}-{mb}-{rep}")
                times.append(time.perf_counter() - start)
            key = f"{'flattened' if flatten else list_name}/{'one_bucket' if mb is None else f'{mb}MB'}"
            results[key] = {
                "s_per_gb": statistics.median(times[1:]) / (size / GB),
                "num_buckets": len(parts),
            }
    return results


def colocated(url: str, named, repeats: int, bucket_mb: int) -> dict:
    """s/GB of every (format, bucket size) through CUDA IPC into the engine at ``url``."""

    async def go():
        async with EngineClient(url, timeout_s=600) as client:

            async def send(part, flatten, version):
                out = await transports.update_from_tensor(
                    [client], part, flatten=flatten, weight_version=version
                )
                if not out[0].get("success", False):
                    raise RuntimeError(f"update_weights_from_tensor failed: {out[0]}")

            return await time_formats(named, repeats, bucket_mb, send, "list")

    results = asyncio.run(go())
    # the trainer's share of a flattened one-bucket sync: torch.cat + pickling the handle
    serialize = cuda_timed(lambda: transports.serialize_bucket(named, flatten=True), repeats)
    results["flattened/one_bucket"]["trainer_serialize_s_per_gb"] = serialize / (nbytes(named) / GB)
    return results


def disaggregated(url: str, named, repeats: int, bucket_mb: int) -> dict:
    """s/GB over NCCL into the engine at ``url`` (on the other GPU)."""

    async def go():
        async with EngineClient(url, timeout_s=600) as client:
            sender = transports.DistributedWeightSender([client], backend="nccl")
            await sender.connect()

            async def send(part, flatten, version):
                out = await sender.send(part, flatten=flatten, weight_version=version)
                if not out[0].get("success", False):
                    raise RuntimeError(f"update_weights_from_distributed: {out[0]}")

            return await time_formats(named, repeats, bucket_mb, send, "per_tensor")

    return asyncio.run(go())


def _nccl_peer(port: int, size: int, repeats: int) -> None:
    """The receiving end of the bandwidth probe (runs on GPU 1)."""
    torch.cuda.set_device(1)
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, False)
    torch.distributed.init_process_group("nccl", store=store, rank=1, world_size=2)
    buffer = torch.empty(size, dtype=torch.uint8, device="cuda:1")
    for _ in range(repeats + 1):
        torch.distributed.broadcast(buffer, src=0)
    torch.cuda.synchronize()
    torch.distributed.destroy_process_group()


def nccl_bound(size: int, repeats: int) -> float:
    """Median seconds of one NCCL broadcast of ``size`` bytes from GPU 0 to GPU 1."""
    import torch.multiprocessing as mp

    port = free_port("127.0.0.1")
    peer = mp.get_context("spawn").Process(target=_nccl_peer, args=(port, size, repeats))
    peer.start()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, True)
    torch.distributed.init_process_group(
        "nccl", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    buffer = torch.ones(size, dtype=torch.uint8, device="cuda:0")
    seconds = cuda_timed(lambda: torch.distributed.broadcast(buffer, src=0), repeats)
    torch.distributed.destroy_process_group()
    peer.join(120)
    return seconds


def physical_gpu(index: int) -> int:
    """The device id of this process's GPU ``index`` (CUDA_VISIBLE_DEVICES may remap)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return int(visible[index]) if visible else index


def start_engine(kind: str, model_dir: Path, gpu: int, log_dir: Path):
    gpu = physical_gpu(gpu)
    env = {"CUDA_VISIBLE_DEVICES": str(gpu)}
    if kind == "sglang":
        return SGLangServer(
            model_dir, sglang_args=SGLANG_ARGS, gpu_ids=[gpu], log_dir=log_dir, ready_timeout_s=900
        ).start()
    return EmbeddedEngine(
        model_dir, device="cuda", dtype="bfloat16", env=env, log_dir=log_dir, ready_timeout_s=600
    ).start()


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="weight_sync-"))
    model_dir = save_model(args.shape, work / "model", seed=0)
    named = trainer_weights(args.shape, seed=1)
    size = nbytes(named)
    copy_s = copy_bound(named, args.repeats)
    report = {
        "shape": args.shape,
        "gb": size / GB,
        "num_tensors": len(named),
        "copy_bound_s_per_gb": copy_s / (size / GB),
        "colocated": {},
        "disaggregated": {},
    }
    if args.disaggregated:
        report["nccl_bound_s_per_gb"] = nccl_bound(size, args.repeats) / (size / GB)
    print(json.dumps(report), flush=True)
    for kind in args.engines.split(","):
        gpus = {} if args.only_disaggregated else {"colocated": 0}
        gpus |= {"disaggregated": 1} if args.disaggregated else {}
        for placement, gpu in gpus.items():
            engine = start_engine(
                kind, model_dir, gpu, Path(os.environ.get("RL_LOG_DIR", work / "logs"))
            )
            try:
                measure = colocated if placement == "colocated" else disaggregated
                report[placement][kind] = measure(engine.url, named, args.repeats, args.bucket_mb)
            finally:
                engine.stop()
            print(json.dumps({placement: {kind: report[placement][kind]}}), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--engines", default="sglang,embedded")
    parser.add_argument("--disaggregated", action="store_true", help="also GPU 0 -> GPU 1")
    parser.add_argument(
        "--only-disaggregated",
        action="store_true",
        help="with --disaggregated: skip the colocated measurement",
    )
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # as SGLang's servers run NCCL
    if not torch.cuda.is_available():
        sys.exit("bench/weight_sync.py needs CUDA (CUDA IPC and NCCL are what it measures)")
    report = run(args)
    report |= {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        write_report(report, args.out)


if __name__ == "__main__":
    main()
