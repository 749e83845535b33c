"""Weight sync from a trainer process into a serving engine: seconds per GB, each next to
its bound measured in the same run; prints and writes one JSON object.

    python bench/weight_sync.py --engines sglang,embedded --out result.json      # 1 GPU
    python bench/weight_sync.py --engines sglang,embedded --disaggregated ...    # 2 GPUs
    python bench/weight_sync.py --device cpu --shape quickstart                  # CPU, embedded
    python bench/weight_sync.py --decode-only                                    # CPU, no engine

Colocated (engine on the trainer's GPU, or on CPU beside it): ``/update_weights_from_tensor``
with CUDA IPC handles (shared-memory files on CPU), as a list of (name, tensor) (one handle
per tensor) or as flattened uint8 buckets (one handle each, metadata alongside), in one
bucket or in buckets of ``--bucket-mb``. Flattened buckets go two ways, timed in turn in
the same repeats: ``fresh`` (a new buffer per bucket) and ``kept`` (the training rank's
send buffers kept for the run, two of them streamed: rl_launcher.infra.weight_sync,
``engine.weight_buffer``). Bound: a copy of the same bytes on the device (one flat
``copy_``).

Disaggregated (engine on GPU 1, trainer on GPU 0): ``/update_weights_from_distributed``
over an NCCL group between the trainer and the engine, one broadcast per tensor or one per
flattened bucket. Bound: an NCCL broadcast of the same bytes between the two GPUs in a
separate two-process group.

``--decode-only``: the embedded engine's decode of a kept one-bucket flattened sync (what
its update log calls "decoded in": the payload the sender pickles back into the bucket's
named views, ``HeldBuffers.named_tensors``), on the CPU, no engine started.

Each figure is the median of ``--repeats`` full syncs of the whole model after one warm-up;
a sync ends when every engine answered (weights applied, version bumped). Every request
has a deadline (``--request-timeout-s``), so a stuck engine fails the bench, not hangs it.
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
from rl_launcher.infra.weight_sync import EngineWeightSync
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
CPU_SHAPES = {  # shapes the CPU run measures (with their dtype)
    "quickstart": {  # examples/quickstart (bench/vs_trl.py's model): 305,408 bytes
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 16,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "dtype": torch.float32,
    },
    "100mb": {  # ~105 MB of bf16
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 8192,
        "dtype": torch.bfloat16,
    },
}


def shape_config(shape: str) -> tuple[dict, torch.dtype]:
    fields = dict(CPU_SHAPES.get(shape) or SHAPES[shape])
    return fields, fields.pop("dtype", torch.bfloat16)


def save_model(shape: str, path: Path, seed: int) -> Path:
    fields, dtype = shape_config(shape)
    config = tiny_config(**fields, max_position_embeddings=4096)
    random_model(config, seed=seed, dtype=dtype).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def trainer_weights(shape: str, seed: int, device: str) -> list[tuple[str, torch.Tensor]]:
    """The trainer's side: unique tensors on ``device`` (a tied lm_head is sent once)."""
    fields, dtype = shape_config(shape)
    model = random_model(tiny_config(**fields), seed=seed, dtype=dtype)
    seen, named = set(), []
    for name, tensor in model.to(device).state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            named.append((name, tensor))
    return named


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def cuda_timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` with the device synchronised around it (after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
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


def figures(times: list[float], size: int, num_buckets: int) -> dict:
    """Median of the timed syncs (the first, a warm-up, left out)."""
    median = statistics.median(times[1:])
    return {
        "s_per_gb": median / (size / GB),
        "ms_per_sync": median * 1e3,
        "num_buckets": num_buckets,
    }


async def time_formats(named, repeats: int, bucket_mb: int, send, list_name: str) -> dict:
    """s/GB of whole-model syncs for each format (per tensor or flattened) and bucket size
    (one bucket or ``bucket_mb``); ``await send(bucket, flatten, version)`` carries one
    bucket and raises when the engine did not apply it."""
    size, results = nbytes(named), {}
    for flatten in (False, True):
        for mb in (None, bucket_mb):
            parts, times = buckets(named, mb), []
            for rep in range(repeats + 1):
                synchronize()
                start = time.perf_counter()
                for part in parts:
                    await send(part, flatten, f"{int(flatten)}-{mb}-{rep}")
                times.append(time.perf_counter() - start)
            key = f"{'flattened' if flatten else list_name}/{'one_bucket' if mb is None else f'{mb}MB'}"
            results[key] = figures(times, size, len(parts))
    return results


SYNCS = {  # colocated: name -> (flatten, engine.weight_buffer)
    "list": (False, "fresh"),
    "flattened": (True, "fresh"),
    "flattened_kept": (True, "kept"),
}


def colocated(url: str, named, repeats: int, bucket_mb: int, timeout_s: float) -> dict:
    """s/GB of every (format, bucket size) through tensor handles into the engine at
    ``url``, each sync as a training rank makes it (rl_launcher's EngineWeightSync). In each
    repeat every format syncs once, in turn, so a busy host slows them alike."""
    size, results = nbytes(named), {}
    for mb in (None, bucket_mb):
        parts, times = buckets(named, mb), {name: [] for name in SYNCS}
        rank = EngineWeightSync(0)  # its buffers kept across the repeats, as in a run
        rank._clients[url] = EngineClient(url, timeout_s=timeout_s)
        for rep in range(repeats + 1):
            for name, (flatten, buffer) in SYNCS.items():
                how = {"transport": "tensor", "flatten": flatten, "buffer": buffer}
                how |= {"tp_size": 1, "senders": [0]}
                synchronize()
                start = time.perf_counter()
                rank.sync(iter(parts), [url], f"{name}-{mb}-{rep}", how)
                times[name].append(time.perf_counter() - start)
        for name in SYNCS:
            key = f"{name}/{'one_bucket' if mb is None else f'{mb}MB'}"
            results[key] = figures(times[name], size, len(parts))
        rank._run(rank._clients[url].close())
    # the trainer's share of a flattened one-bucket sync: torch.cat + pickling the handle
    # (fresh), or the copy into the kept buffer + pickling (kept)
    serialize = cuda_timed(lambda: transports.serialize_bucket(named, flatten=True), repeats)
    kept = transports.SendBuffer()
    pack = cuda_timed(lambda: transports.dump_payload(kept.fill(named)), repeats)
    results["flattened/one_bucket"]["trainer_serialize_s_per_gb"] = serialize / (size / GB)
    results["flattened_kept/one_bucket"]["trainer_serialize_s_per_gb"] = pack / (size / GB)
    return results


def disaggregated(url: str, named, repeats: int, bucket_mb: int, timeout_s: float) -> dict:
    """s/GB over NCCL into the engine at ``url`` (on the other GPU)."""

    async def go():
        async with EngineClient(url, timeout_s=timeout_s) as client:
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


def start_engine(kind: str, model_dir: Path, gpu: int | None, log_dir: Path):
    """The engine on GPU ``gpu``, or on CPU (None). The embedded engine's decode step is
    not compiled: its start takes seconds instead of minutes, and a weight update does
    not touch the compiled step (the static runner's weight copies are still made)."""
    if gpu is None:
        return EmbeddedEngine(model_dir, device="cpu", log_dir=log_dir, ready_timeout_s=600).start()
    gpu = physical_gpu(gpu)
    env = {"CUDA_VISIBLE_DEVICES": str(gpu)}
    if kind == "sglang":
        return SGLangServer(
            model_dir, sglang_args=SGLANG_ARGS, gpu_ids=[gpu], log_dir=log_dir, ready_timeout_s=900
        ).start()
    return EmbeddedEngine(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        env=env,
        log_dir=log_dir,
        ready_timeout_s=600,
        extra_args=["--no-compile"],
    ).start()


def decode_only(shape: str, repeats: int) -> dict:
    """Milliseconds per decode of the one-bucket payload of ``shape``'s tensors (a tied
    lm_head sent once) as the sender pickles it at every sync: through its kept buffer
    (the bucket's views reused) and fresh (a new buffer: views cut, shared memory opened).
    The tensors are two elements each: the decode costs per record, not per byte."""
    from transformers import AutoModelForCausalLM

    from rl_sglang.engine.weights import HeldBuffers

    fields, dtype = shape_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(**fields), dtype=dtype)
    named = [(n, torch.zeros([2] * p.dim(), dtype=dtype)) for n, p in model.named_parameters()]
    buffer, held = transports.SendBuffer(), HeldBuffers()
    first = held.named_tensors([transports.dump_payload(buffer.fill(named))], "flattened_bucket")
    times = {"kept": [], "fresh": []}
    for _ in range(40 * repeats):
        for way, times_of_way in times.items():
            keep_alive = None
            if way == "kept":
                payload = transports.dump_payload(buffer.fill(named))
            else:
                payload, keep_alive = transports.serialize_bucket(named, flatten=True)
            start = time.perf_counter()
            got = held.named_tensors([payload], "flattened_bucket")
            times_of_way.append(time.perf_counter() - start)
            assert (got is first) == (way == "kept"), "a kept layout cut again, or a fresh reused"
            del got, keep_alive
    buffer.release()
    report = {"num_records": len(named), "payload_chars": len(payload), "decodes": 40 * repeats}
    for way, times_of_way in times.items():
        times_of_way.sort()
        report[f"{way}_ms_per_decode"] = statistics.median(times_of_way) * 1e3
        report[f"{way}_ms_p90"] = times_of_way[int(0.9 * len(times_of_way))] * 1e3
    return report


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="weight_sync-"))
    model_dir = save_model(args.shape, work / "model", seed=0)
    named = trainer_weights(args.shape, seed=1, device="cuda:0" if args.device == "cuda" else "cpu")
    size = nbytes(named)
    copy_s = copy_bound(named, args.repeats)
    report = {
        "shape": args.shape,
        "device": args.device,
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
            log_dir = Path(os.environ.get("RL_LOG_DIR", work / "logs"))
            engine = start_engine(kind, model_dir, gpu if args.device == "cuda" else None, log_dir)
            try:
                measure = colocated if placement == "colocated" else disaggregated
                report[placement][kind] = measure(
                    engine.url, named, args.repeats, args.bucket_mb, args.request_timeout_s
                )
            finally:
                engine.stop()
            print(json.dumps({placement: {kind: report[placement][kind]}}), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help=f"{sorted(SHAPES) + sorted(CPU_SHAPES)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--engines", default=None, help="default: sglang,embedded (cpu: embedded)")
    parser.add_argument("--disaggregated", action="store_true", help="also GPU 0 -> GPU 1")
    parser.add_argument(
        "--only-disaggregated",
        action="store_true",
        help="with --disaggregated: skip the colocated measurement",
    )
    parser.add_argument("--bucket-mb", type=int, default=None, help="default: 256 (cpu: 32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--decode-only",
        action="store_true",
        help="time the embedded engine's decode of a kept bucket on the CPU (default shape 0.5b)",
    )
    args = parser.parse_args()
    if args.decode_only:
        args.shape = args.shape or "0.5b"
        report = {"shape": args.shape, "decode_only": decode_only(args.shape, args.repeats)}
        report |= {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}
        report |= {"python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
        print(json.dumps(report, indent=2))
        if args.out:
            write_report(report, args.out)
        return
    cpu = args.device == "cpu"
    args.shape = args.shape or ("quickstart" if cpu else "0.5b")
    args.engines = args.engines or ("embedded" if cpu else "sglang,embedded")
    args.bucket_mb = args.bucket_mb or (32 if cpu else 256)
    if args.shape not in SHAPES and args.shape not in CPU_SHAPES:
        parser.error(f"--shape: choose one of {sorted(SHAPES) + sorted(CPU_SHAPES)}")
    if cpu and (args.engines != "embedded" or args.disaggregated):
        parser.error("--device cpu measures the embedded engine, colocated (--engines embedded)")
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # as SGLang's servers run NCCL
    if not cpu and not torch.cuda.is_available():
        sys.exit("bench/weight_sync.py needs CUDA (CUDA IPC and NCCL); --device cpu for CPU")
    report = run(args)
    report |= {
        "gpu": torch.cuda.get_device_name(0) if not cpu else None,
        "cpu": platform.processor() or platform.machine(),
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
