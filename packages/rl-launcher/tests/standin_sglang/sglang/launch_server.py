"""A stand-in for ``python -m sglang.launch_server``, for tests of engines over several
nodes without SGLang or GPUs (``tests/test_multinode_engines.py`` puts this folder's parent
on the servers' PYTHONPATH through ``RL_SGLANG_PYTHONPATH``).

It writes its command line, pid, parent pid and CUDA_VISIBLE_DEVICES to
``$STANDIN_SGLANG_RECORDS/<pid>.json``. As SGLang's ranks do, the node ranks meet at
``--dist-init-addr`` before the engine is ready: node rank 0 listens there (on node 0's
address) until every other rank has connected; then it alone serves HTTP on
``--host:--port`` (/health, /health_generate, /get_model_info, /model_info,
/get_server_info, /server_info, /generate answering one token, and to a request with
``return_routed_experts`` SGLang's ``meta_info["routed_experts"]`` of one layer, top-1,
each token's expert its id). The other ranks serve nothing and run until they are stopped.
"""

import argparse
import array
import base64
import json
import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MEET_TIMEOUT_S = 120.0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--port", "--dist-init-addr", "--weight-version"):
        parser.add_argument(flag)
    for flag in ("--tp-size", "--nnodes", "--node-rank"):
        parser.add_argument(flag, type=int, default=None)
    return parser.parse_known_args(argv)[0]


def record() -> None:
    entry = {
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    folder = Path(os.environ["STANDIN_SGLANG_RECORDS"])
    (folder / f"{os.getpid()}.json").write_text(json.dumps(entry))


def meet(args: argparse.Namespace) -> list[socket.socket]:
    """Node rank 0: the other ranks' connections, once all came; others: their own."""
    host, port = args.dist_init_addr.rsplit(":", 1)
    if args.node_rank == 0:
        with socket.create_server((host, int(port))) as server:
            server.settimeout(MEET_TIMEOUT_S)
            return [server.accept()[0] for _ in range(args.nnodes - 1)]
    deadline = time.monotonic() + MEET_TIMEOUT_S
    while True:
        try:
            return [socket.create_connection((host, int(port)), timeout=5)]
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def handler(args: argparse.Namespace):
    info = {
        "model_path": args.model_path,
        "weight_version": args.weight_version or "default",
        "is_generation": True,
        "tp_size": args.tp_size,
        "nnodes": args.nnodes or 1,
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path in ("/health", "/health_generate"):
                return self.answer({})
            if self.path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
                return self.answer(info)
            return self.answer({"error": self.path}, status=404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or "{}")
            if self.path != "/generate":
                return self.answer({"error": self.path}, status=404)
            prompt = body.get("input_ids") or []
            meta = {
                "id": "standin",
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(prompt),
                "completion_tokens": 1,
                "output_token_logprobs": [[-0.5, 1, None]],
                "weight_version": info["weight_version"],
            }
            if body.get("return_routed_experts"):  # SGLang's form: 1 layer, top-1 = token id
                ran = array.array("i", [*prompt, 1][:-1])  # every token but the last
                meta["routed_experts"] = base64.b64encode(ran.tobytes()).decode("ascii")
            return self.answer({"text": "1", "output_ids": [1], "meta_info": meta})

        def answer(self, payload: dict, status: int = 200) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    return Handler


def main() -> None:
    args = parse(sys.argv[1:])
    record()
    peers = meet(args) if (args.nnodes or 1) > 1 else []
    if args.node_rank:
        while True:  # a scheduler of the engine: no HTTP, runs until stopped
            time.sleep(3600)
    server = ThreadingHTTPServer((args.host, int(args.port)), handler(args))
    print(f"stand-in sglang: serving on {args.host}:{args.port} with {len(peers)} peer(s)")
    server.serve_forever()


if __name__ == "__main__":
    main()
