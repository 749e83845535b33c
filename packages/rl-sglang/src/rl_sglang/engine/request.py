"""One generation request inside the embedded engine and its SGLang-shaped result."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_core.routing import encode_routes
from rl_sglang.protocol import SamplingParams, finish_reason, finite_logprobs, token_logprobs


@dataclass(eq=False)
class Request:
    """A prompt being generated. ``on_done(request)`` is called once, from the scheduler
    thread, when ``finish`` is set; ``on_token(request)`` after every new token."""

    rid: str
    parent_rid: str | None  # the request's own rid when it is one of n samples
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int | None = None  # >= 0 with return_logprob: prompt log-probs too
    on_done: Callable[["Request"], None] | None = None
    on_token: Callable[["Request"], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # of prompt_ids[logprob_start_len:]
    finish: dict[str, Any] | None = None
    text: str = ""
    weight_version: str = ""
    created: float = field(default_factory=time.monotonic)
    adapter: Any = None  # the LoRA adapter its ``lora_path`` named (engine.lora.Adapter)
    return_routed_experts: bool = False  # SGLang's field: meta_info["routed_experts"]
    routes: list[torch.Tensor] = field(default_factory=list)  # [n, L, K] chunks (engine.routes)
    stop_rule: Any = None  # engine.stopping.StopRule, made at the first check

    def matches(self, rid: str | None) -> bool:
        """True when an abort of ``rid`` (None = all) concerns this request."""
        return rid is None or rid in (self.rid, self.parent_rid)

    def finish_with(self, reason: dict[str, Any]) -> None:
        assert self.finish is None, f"request {self.rid} finished twice"
        self.finish = reason
        if self.on_done is not None:
            self.on_done(self)

    def abort(self, message: str = "aborted") -> None:
        if self.finish is None:
            self.finish_with(finish_reason("abort", message=message))

    def finite(self) -> bool:
        """True when the response's log-probs hold no NaN or infinity
        (:func:`rl_sglang.protocol.encode_json` may then use orjson)."""
        return finite_logprobs(self.output_logprobs) and finite_logprobs(self.input_logprobs or [])

    def response(self) -> dict[str, Any]:
        """The /generate response: ``text``, ``output_ids`` and ``meta_info``."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - self.created,
            "weight_version": self.weight_version,
        }
        if self.return_logprob:
            meta["output_token_logprobs"] = token_logprobs(self.output_logprobs, self.output_ids)
        if self.return_logprob and self.input_logprobs is not None:
            ids = self.prompt_ids[len(self.prompt_ids) - len(self.input_logprobs) :]
            meta["input_token_logprobs"] = token_logprobs(self.input_logprobs, ids)
        if self.return_routed_experts and self.routes:
            # every token run: the prompt and all outputs but the last (a look-ahead step
            # may have run one more, past a stop)
            num_run = len(self.prompt_ids) + len(self.output_ids) - 1
            meta["routed_experts"] = encode_routes(torch.cat(self.routes)[:num_run])
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
