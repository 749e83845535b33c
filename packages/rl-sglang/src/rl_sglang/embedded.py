"""The embedded engine's HTTP server: SGLang's native endpoints over aiohttp.

    python -m rl_sglang.embedded --model-path DIR [--port 30000] [--device cpu]

``--model-path`` is an HF directory, or a ``config.json`` file for random weights.
"""

import argparse
import asyncio
import gc
import hmac
import json
import logging
import os
import sys
import time
from typing import Any

from aiohttp import web

from rl_sglang.engine import weights
from rl_sglang.engine.core import Engine, load_model
from rl_sglang.engine.precision import tf32_hint
from rl_sglang.process import API_KEY_ENV, check_exposure
from rl_sglang.protocol import encode_json

ENGINE_KEY = web.AppKey("engine", Engine)
API_KEY = web.AppKey("api_key", str)
HELD_KEY = web.AppKey("held_buffers", weights.HeldBuffers)  # kept senders' handles, open
routes = web.RouteTableDef()
logger = logging.getLogger("rl_sglang.embedded")  # also when run as __main__


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    return await request.json()


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response(  # error_message: SGLang's field in LoRA answers
        {"success": False, "message": message, "error": message, "error_message": message},
        status=status,
    )


@web.middleware
async def errors_as_json(request: web.Request, handler):
    """User errors come back as 400 with the message, not as a bare 500."""
    try:
        return await handler(request)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
        return _error(f"{type(error).__name__}: {error}")


@web.middleware
async def require_api_key(request: web.Request, handler):
    """SGLang's ``--api-key``: with a key set, every endpoint but ``/health*`` needs
    ``Authorization: Bearer <key>`` (weight updates, memory release, abort, pause, flush
    and generation alike)."""
    key = request.app[API_KEY]
    if key and not request.path.startswith("/health"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return _error("missing or wrong 'Authorization: Bearer <api key>'", status=401)
    return await handler(request)


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


@routes.get("/health_generate")
async def health_generate(request: web.Request) -> web.Response:
    engine = _engine(request)
    if engine.scheduler.paused or engine.weights_dropped:  # alive, deliberately not generating
        return web.Response(text="")
    groups, _ = engine.make_requests({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}})
    await asyncio.wait_for(engine.run(groups[0]), timeout=30)
    return web.Response(text="")


@routes.get("/get_model_info")
@routes.get("/model_info")
async def model_info(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).model_info())


@routes.get("/get_server_info")
@routes.get("/server_info")
async def server_info(request: web.Request) -> web.Response:
    return web.json_response(_engine(request).server_info())


@routes.get("/get_weight_version")
async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": _engine(request).weight_version})


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    engine, body = _engine(request), await _body(request)
    groups, is_batch = engine.make_requests(body)
    if body.get("stream"):
        return await _stream(request, engine, groups, is_batch)
    flat = iter(await engine.run([r for group in groups for r in group]))  # one admission
    outputs = [[next(flat) for _ in group] for group in groups]
    results = [out[0] if len(out) == 1 else out for out in outputs]
    if is_batch:  # SGLang flattens n samples of a batch into one list
        results = [item for out in outputs for item in out]
    finite = all(request.finite() for group in groups for request in group)
    return _json(results if is_batch else results[0], finite=finite)


def _json(data: Any, *, finite: bool) -> web.Response:
    """``web.json_response(data)``, encoded by :func:`rl_sglang.protocol.encode_json`:
    with json this event loop spent twice the CPU a rollout of 1,024 responses with
    per-token log-probs (0.10 against 0.05 s at 64 tokens each), holding the GIL the
    scheduler thread needs. The header is json_response's (UTF-8 JSON)."""
    body = encode_json(data, finite=finite)
    return web.Response(body=body, content_type="application/json", charset="utf-8")


async def _stream(request, engine: Engine, groups, is_batch: bool) -> web.StreamResponse:
    """Server-sent events: one ``data: {...}`` per new token (cumulative text and ids),
    then ``data: [DONE]``; ``index`` tells the requests of a batch or of n apart."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    requests = [r for group in groups for r in group]
    decode = engine.scheduler.stopper.decode

    def on_token(item, index):  # on the scheduler thread: snapshot before the next token
        chunk = item.response() | {"text": decode(item.output_ids, item), "index": index}
        loop.call_soon_threadsafe(queue.put_nowait, chunk)

    for index, item in enumerate(requests):
        item.on_token = lambda r, i=index: on_token(r, i)
    run = asyncio.ensure_future(engine.run(requests))
    run.add_done_callback(lambda _: queue.put_nowait(None))
    while (chunk := await queue.get()) is not None:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    for index, final in enumerate(run.result()):
        await response.write(f"data: {json.dumps(final | {'index': index})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request)
    rid = None if body.get("abort_all") else body.get("rid")
    if rid is None and not body.get("abort_all"):
        return _error("send {'rid': ...} or {'abort_all': true}")
    # answered once applied: a queued abort-all would also abort requests sent after it
    await asyncio.wrap_future(_engine(request).scheduler.abort(rid))
    return web.json_response({"success": True})


@routes.post("/pause_generation")
async def pause_generation(request: web.Request) -> web.Response:
    mode = (await _body(request)).get("mode", "abort")
    num = await asyncio.wrap_future(_engine(request).scheduler.pause(mode))
    return web.json_response(
        {"success": True, "message": f"paused ({mode})", "num_paused_requests": num}
    )


@routes.post("/continue_generation")
async def continue_generation(request: web.Request) -> web.Response:
    await asyncio.wrap_future(_engine(request).scheduler.resume())
    return web.json_response({"success": True, "message": "continued"})


@routes.route("*", "/flush_cache")
async def flush_cache(request: web.Request) -> web.Response:
    # No prefix cache is kept between requests; flushing only returns freed memory.
    engine = _engine(request)
    await engine.on_scheduler(lambda: engine.device.type == "cuda" and _empty_cuda_cache())
    return web.Response(text="Cache flushed.")


@routes.route("*", "/freeze_gc")
async def freeze_gc(request: web.Request) -> web.Response:
    # One process here (server and scheduler thread): what is alive now is never scanned again
    gc.freeze()
    return web.Response(text=f"Garbage collection frozen: {gc.get_freeze_count()} objects.\n")


def _empty_cuda_cache() -> None:
    import torch

    torch.cuda.empty_cache()


@routes.post("/release_memory_occupation")
async def release_memory_occupation(request: web.Request) -> web.Response:
    engine, body = _engine(request), await _body(request)
    # held send buffers stay open: a sender keeps its buffers for the run, so the next sync
    # reuses the mappings (they are the sender's memory, not the engine's)
    # weights named in the tags are dropped, as SGLang drops them (no CPU backup): a
    # colocated trainer syncs all of them before the next rollout; without tags they stay
    keep = "weights" not in (body.get("tags") or ())
    await engine.on_scheduler(lambda: engine.release_memory(keep_weights=keep))
    return web.json_response({"success": True, "message": "memory released"})


@routes.post("/resume_memory_occupation")
async def resume_memory_occupation(request: web.Request) -> web.Response:
    engine = _engine(request)
    await engine.on_scheduler(engine.resume_memory)
    return web.json_response({"success": True, "message": "memory resumed"})


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine, body = _engine(request), await _body(request)
    named = await asyncio.to_thread(weights.read_safetensors_dir, body["model_path"])
    return web.json_response(await engine.on_scheduler(lambda: engine.apply_update(named, body)))


@routes.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: web.Request) -> web.Response:
    engine, body = _engine(request), await _body(request)
    start = time.perf_counter()
    # a kept send buffer comes back under the same handle: its views and copy plan are reused
    named = request.app[HELD_KEY].named_tensors(
        body["serialized_named_tensors"], body.get("load_format")
    )
    decoded, count = time.perf_counter(), len(named)
    update = _once(engine.apply_update, named, body)
    del named
    answer = await engine.on_scheduler(update)
    logger.info(
        "weight update to version %s: %d tensors, decoded in %.1f ms, applied in %.1f ms",
        answer.get("weight_version"),
        count,
        (decoded - start) * 1e3,
        (time.perf_counter() - decoded) * 1e3,
    )
    return web.json_response(answer)


def _once(fn, *args):
    """``fn(*args)`` as a callable that lets go of ``args`` when it runs: the scheduler
    thread holds its last task until the next, and a weight tensor it held would outlive
    the update (a shared-memory tensor freed at exit, after the trainer's shared-memory
    manager is gone, aborts the process)."""
    box = [args]
    return lambda: fn(*box.pop())


@routes.post("/load_lora_adapter")
async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = _engine(request)
    return web.json_response(await engine.load_lora_adapter(await _body(request)))


@routes.post("/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = _engine(request)
    return web.json_response(await engine.unload_lora_adapter(await _body(request)))


@routes.post("/update_weight_version")
async def update_weight_version(request: web.Request) -> web.Response:
    engine, body = _engine(request), await _body(request)
    return web.json_response(await engine.on_scheduler(lambda: engine.update_weight_version(body)))


@routes.post("/init_weights_update_group")
async def init_weights_update_group(request: web.Request) -> web.Response:
    engine, body = _engine(request), await _body(request)
    group_name = body.get("group_name", "weight_update_group")
    receiver = await asyncio.to_thread(
        weights.WeightReceiver,
        master_address=body["master_address"],
        master_port=body["master_port"],
        rank=int(body["rank_offset"]),  # TP 1: the engine's only rank
        world_size=int(body["world_size"]),
        group_name=group_name,
        backend=body.get("backend", "nccl"),
    )
    engine.weight_receivers[group_name] = receiver
    return web.json_response({"success": True, "message": f"joined {group_name}"})


@routes.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    engine, body = _engine(request), await _body(request)
    group_name = body.get("group_name", "weight_update_group")
    if group_name not in engine.weight_receivers:
        return _error(f"no weight-update group {group_name!r}; call /init_weights_update_group")
    receiver = engine.weight_receivers[group_name]

    def receive_and_apply():
        named = receiver.receive(
            body["names"],
            body["dtypes"],
            body["shapes"],
            engine.device,
            load_format=body.get("load_format"),
        )
        return engine.apply_update(named, body)

    return web.json_response(await engine.on_scheduler(receive_and_apply))


def make_app(engine: Engine, api_key: str | None = None) -> web.Application:
    app = web.Application(middlewares=[require_api_key, errors_as_json], client_max_size=1 << 30)
    app[ENGINE_KEY], app[API_KEY] = engine, api_key or ""
    app[HELD_KEY] = weights.HeldBuffers()
    app.add_routes(routes)
    app.on_shutdown.append(_drop_held_buffers)  # while their senders are still there
    app.on_shutdown.append(lambda _: asyncio.to_thread(engine.scheduler.stop))
    return app


async def _drop_held_buffers(app: web.Application) -> None:
    app[HELD_KEY].drop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="HF model dir or a config.json")
    parser.add_argument("--host", default="127.0.0.1", help="any other address needs a key")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"Bearer token for every endpoint but /health (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--runner", default="auto", help="auto, dynamic or static (CUDA graphs)")
    parser.add_argument("--max-context", type=int, default=None, help="prompt + response cap")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the static runner's decode step (default: on with CUDA)",
    )
    parser.add_argument(
        "--stable-memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="static runner: weights and KV cache keep their addresses across a memory "
        "release, so resuming maps memory back instead of capturing CUDA graphs again "
        "(default: on with CUDA)",
    )
    parser.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="static runner on CUDA: share of the device's memory the engine may hold "
        "(weights, KV slots, graphs); --max-batch-size is lowered to the slots that fit "
        "(default: no bound)",
    )
    parser.add_argument(
        "--decode-attention",
        default="auto",
        choices=["auto", "triton", "sdpa"],
        help="static runner: the decode step's attention (auto: Triton kernels on CUDA)",
    )
    parser.add_argument(
        "--sampled-multi-step",
        action="store_true",
        help="static runner: sampled batches decode in rounds of several steps as greedy "
        "ones do, each draw inside the round (a seeded row's tokens are unchanged)",
    )
    parser.add_argument("--seed", type=int, default=0, help="init seed for a bare config")
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)"
    )
    parser.add_argument("--max-lora-rank", type=int, default=None, help="default: any rank")
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="MoE models: requests may ask return_routed_experts (rollout routing replay)",
    )
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=["all"],
        help="Linears adapters may adapt (q_proj v_proj ...), or all (every Linear but lm_head)",
    )
    args = parser.parse_args(argv)
    try:
        check_exposure(args.host, args.api_key, "the embedded engine")
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> None:
    """Load, prepare the runner and serve; each start-up phase is a line with its time (the
    runner's can take minutes on CUDA: compiling the decode step, capturing graphs)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # sglang-router probes workers for gRPC first; aiohttp would log each probe as an error.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    start = time.perf_counter()
    model, tokenizer = load_model(
        args.model_path, device=args.device, dtype=args.dtype, seed=args.seed
    )
    weight = next(model.parameters())
    dtype = str(weight.dtype).removeprefix("torch.")
    print(
        f"embedded engine: model loaded in {time.perf_counter() - start:.1f}s "
        f"({weight.device}, {dtype}); preparing the runner",
        flush=True,
    )
    if (hint := tf32_hint(weight.device, weight.dtype)) is not None:
        print(f"embedded engine: {hint}; --dtype bfloat16 serves bfloat16 weights", flush=True)
    start = time.perf_counter()
    engine = Engine(
        model,
        tokenizer,
        model_path=args.model_path,
        max_batch_size=args.max_batch_size,
        runner=args.runner,
        max_context=args.max_context,
        compile=args.compile,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        lora_targets=tuple(args.lora_target_modules),
        enable_return_routed_experts=args.enable_return_routed_experts,
        stable_memory=args.stable_memory,
        mem_fraction=args.mem_fraction,
        decode_attention=args.decode_attention,
        sampled_multi_step=args.sampled_multi_step,
    )
    engine.scheduler.weight_version = args.weight_version
    print(
        f"embedded engine ready on http://{args.host}:{args.port} ({engine.runner_kind} "
        f"runner, {dtype}, context {engine.max_context}{_decode_mode(engine)}; runner prepared "
        f"in {time.perf_counter() - start:.1f}s)",
        flush=True,
    )
    web.run_app(
        make_app(engine, args.api_key), host=args.host, port=args.port, print=None, access_log=None
    )
    exit_now()


def _decode_mode(engine: Engine) -> str:
    """The static runner's decode attention and sampled rounds, for the ready line."""
    runner = engine.scheduler.runner
    fused = getattr(runner, "fused_attention", None)
    mode = "" if fused is None else f", decode attention {'triton' if fused else 'sdpa'}"
    if getattr(runner, "sampled_multi_step", False):
        mode += f", sampled rounds of {runner.multi_step} steps"
    return mode


def exit_now() -> None:
    """Leave once the server has shut down (SIGTERM or SIGINT: requests finished or
    aborted, the scheduler stopped), without tearing down the interpreter: unloading
    torch and transformers module by module took 2-3 s of the run's shutdown on a 2-core
    CPU, and nothing in this process needs it (weight handles are the trainer's to free)."""
    print("embedded engine: shut down", flush=True)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
