"""An external rollout buffer: agent workers anywhere ``POST /buffer/write`` finished,
scored trajectories; the trainer collects groups of them.

    buffer = RolloutBuffer("run/buffer.json", api_key=key)
    url = await buffer.start(host="0.0.0.0", port=8700)   # a key is needed off loopback
    groups = await buffer.collect(8, min_ratio=0.5, timeout_s=300)

A write is ``{"group": "<id>", "samples": [{"tokens": [...], "prompt_length": P,
"reward": r, "loss_mask": [...]?, "rollout_log_probs": [...]?, "weight_versions": [...]?,
"metadata": {...}?}, ...]}`` (a group: the samples of one task, for group-relative
advantages). A bad payload gets a 400 naming what is wrong and is counted
(``counts["rejected"]``). Every accepted group is written to ``path`` (temporary file,
fsync, rename) before the write is acknowledged, and served groups leave it the same way,
so a restarted trainer finds every group it was sent and had not yet collected. With
``until_settled=True`` (rl-train's ``rollout.source: buffer``) a served group stays in the
file, numbered, until the trainer settles it (:meth:`settle`: its training is in a complete
checkpoint); :meth:`requeue_after` puts the ones a resumed trainer never checkpointed back
at the front, so nothing accepted is lost to a trainer that dies between checkpoints.
:meth:`collect` returns as soon as ``num_groups`` groups are there; after ``timeout_s``
it returns what arrived if that is at least ``min_ratio`` of them, else raises
``TimeoutError``.
"""

import asyncio
import hmac
import json
import math
import os
from pathlib import Path

from aiohttp import web

from rl_core.types import Sample, SampleStatus
from rl_sglang.process import check_exposure


class BadPayload(ValueError):
    """A write the buffer refuses (400)."""


def parse_sample(data, where: str) -> Sample:
    """One written sample as a Sample; :class:`BadPayload` naming the field otherwise."""
    if not isinstance(data, dict):
        raise BadPayload(f"{where}: expected an object")
    tokens, prompt_length = data.get("tokens"), data.get("prompt_length")
    if (
        not isinstance(tokens, list)
        or not tokens
        or not all(type(t) is int and t >= 0 for t in tokens)
    ):
        raise BadPayload(f"{where}.tokens: expected a non-empty list of token ids")
    if type(prompt_length) is not int or not 0 < prompt_length < len(tokens):
        raise BadPayload(f"{where}.prompt_length: expected an int in 1..{len(tokens) - 1}")
    reward = data.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise BadPayload(f"{where}.reward: expected a finite number")
    response_length = len(tokens) - prompt_length
    for key in ("loss_mask", "rollout_log_probs"):
        value = data.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != response_length):
            raise BadPayload(f"{where}.{key}: expected a list of {response_length} numbers")
    if data.get("loss_mask") is not None and any(m not in (0, 1) for m in data["loss_mask"]):
        raise BadPayload(f"{where}.loss_mask: expected 0 or 1 per response token")
    return Sample(
        prompt=data.get("prompt", ""),
        tokens=tokens,
        response_length=response_length,
        loss_mask=data.get("loss_mask"),
        rollout_log_probs=data.get("rollout_log_probs"),
        reward=float(reward),
        status=SampleStatus.COMPLETED,
        weight_versions=[str(v) for v in data.get("weight_versions", [])],
        metadata=dict(data.get("metadata") or {}),
    )


def parse_group(payload) -> tuple[str, list[Sample]]:
    if not isinstance(payload, dict):
        raise BadPayload("expected a JSON object {'group': id, 'samples': [...]}")
    group, samples = payload.get("group"), payload.get("samples")
    if not isinstance(group, str) or not group:
        raise BadPayload("group: expected a non-empty string id")
    if not isinstance(samples, list) or not samples:
        raise BadPayload("samples: expected a non-empty list")
    return group, [parse_sample(s, f"samples[{i}]") for i, s in enumerate(samples)]


class RolloutBuffer:
    """The buffer (see the module docstring); ``path`` holds what is not yet served."""

    def __init__(self, path: str | Path, *, api_key: str | None = None, until_settled=False):
        self.path, self.api_key, self.until_settled = Path(path), api_key, until_settled
        self.pending: dict[str, list[dict]] = {}
        self.served: list[tuple[int, str, list[dict]]] = []  # (serve number, group, samples)
        self.num_served = 0  # serve numbers so far (the last one given)
        if self.path.exists():
            saved = json.loads(self.path.read_text())
            self.pending, self.num_served = saved["pending"], saved["num_served"]
            self.served = [tuple(entry) for entry in saved["served"]]
        self.counts = {"accepted": 0, "rejected": 0, "duplicates": 0, "served": 0}
        self._arrived = asyncio.Event()
        self._runner: web.AppRunner | None = None

    def _persist(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(
                {"pending": self.pending, "served": self.served, "num_served": self.num_served}, f
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def write(self, payload) -> int:
        """Accept one group (persisted before this returns); :class:`BadPayload` if bad."""
        try:
            group, samples = parse_group(payload)
        except BadPayload:
            self.counts["rejected"] += 1
            raise
        if group in self.pending or any(name == group for _, name, _ in self.served):
            self.counts["duplicates"] += 1  # a worker's retry: the first write stands
            return 0
        self.pending[group] = [s.to_dict() for s in samples]
        self._persist()
        self.counts["accepted"] += 1
        self._arrived.set()
        return len(samples)

    def take(self, num_groups: int) -> list[list[Sample]]:
        """Up to ``num_groups`` groups, oldest first, removed from the file."""
        names = list(self.pending)[:num_groups]
        groups = []
        for number, name in enumerate(names):
            self.num_served += 1
            data = self.pending.pop(name)
            if self.until_settled:
                self.served.append((self.num_served, name, data))
            groups.append([Sample.from_dict(d) for d in data])
            for index, sample in enumerate(groups[-1]):
                sample.group_index, sample.index = number, index
                sample.metadata["buffer_group"] = name
                sample.metadata["buffer_serve"] = self.num_served
        if names:
            self._persist()
        self.counts["served"] += len(groups)
        return groups

    def settle(self, through: int) -> None:
        """Forget the served groups numbered ``through`` or lower (trained and saved)."""
        kept = [entry for entry in self.served if entry[0] > through]
        if len(kept) != len(self.served):
            self.served = kept
            self._persist()

    def requeue_after(self, through: int) -> int:
        """Served groups numbered above ``through`` go back to the front of the queue, in
        serve order (a resumed trainer's checkpoint holds the training of the others, which
        are forgotten); returns how many went back."""
        back = [(name, data) for number, name, data in self.served if number > through]
        self.pending = {**dict(back), **self.pending}
        self.served = []
        self._persist()
        if back:
            self._arrived.set()
        return len(back)

    async def collect(self, num_groups: int, *, min_ratio: float = 1.0, timeout_s: float = 600.0):
        """``num_groups`` groups, or after ``timeout_s`` at least ``min_ratio`` of them."""
        if not 0 < min_ratio <= 1:
            raise ValueError(f"min_ratio must be in (0, 1], got {min_ratio}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(self.pending) < num_groups:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break
        needed = math.ceil(min_ratio * num_groups)
        if len(self.pending) < needed:
            raise TimeoutError(
                f"the rollout buffer holds {len(self.pending)} groups after {timeout_s:g} s, "
                f"fewer than min_ratio={min_ratio:g} of {num_groups}: are the agent workers "
                "writing to it? (raise timeout_s or lower min_ratio)"
            )
        return self.take(num_groups)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        check_exposure(host, self.api_key, "the rollout buffer")
        app = web.Application(middlewares=[self._auth], client_max_size=256 << 20)
        app.router.add_post("/buffer/write", self._write)
        app.router.add_get("/buffer/stats", self._stats)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return f"http://{host}:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return web.json_response(
                    {"error": "missing or wrong 'Authorization: Bearer <api key>'"}, status=401
                )
        return await handler(request)

    async def _write(self, request: web.Request) -> web.Response:
        try:
            payload = await request.json()
        except json.JSONDecodeError as error:
            self.counts["rejected"] += 1
            return web.json_response({"error": f"not JSON: {error}"}, status=400)
        try:
            accepted = self.write(payload)
        except BadPayload as error:
            return web.json_response({"error": str(error)}, status=400)
        return web.json_response({"accepted": accepted, "pending": len(self.pending)})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.counts, "pending": len(self.pending)})
