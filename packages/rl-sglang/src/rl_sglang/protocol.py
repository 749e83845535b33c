"""The subset of SGLang's native HTTP API that rl-sglang speaks, as plain data.

Field names follow SGLang's ``io_struct.py`` (``GenerateReqInput``, the weight-update
request inputs) and the ``meta_info`` its ``/generate`` returns. The embedded engine parses
requests with these helpers and the client builds them, so both sides agree by
construction; ``tests/test_contract.py`` pins the names.
"""

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

try:  # a JSON codec several times faster than json (sglang-router depends on it)
    import orjson
except ImportError:  # json alone: same answers, more CPU time per response
    orjson = None

# /generate request fields we send or accept (GenerateReqInput).
GENERATE_FIELDS = (
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "stream",
    "rid",
)
# meta_info keys every /generate response carries (output_token_logprobs with return_logprob).
META_INFO_FIELDS = (
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
    "weight_version",
)
FINISH_TYPES = ("stop", "length", "abort")
PAUSE_MODES = ("abort", "retract", "in_place")
# Weight-update request fields (UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
# InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput).
UPDATE_FROM_DISK_FIELDS = ("model_path", "load_format", "abort_all_requests", "weight_version")
UPDATE_FROM_TENSOR_FIELDS = (
    "serialized_named_tensors",
    "load_format",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
)
INIT_GROUP_FIELDS = (
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "group_name",
    "backend",
)
UPDATE_FROM_DISTRIBUTED_FIELDS = (
    "names",
    "dtypes",
    "shapes",
    "group_name",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
)


@dataclass(kw_only=True)
class SamplingParams:
    """SGLang's ``sampling_params`` (the subset the embedded engine implements).

    ``temperature == 0`` means greedy. ``top_k == -1`` and ``top_p == 1`` disable those
    filters; ``min_p`` keeps tokens whose probability is at least ``min_p`` times the top
    one. ``stop`` strings and ``stop_token_ids`` end a response (``ignore_eos`` keeps going
    past the tokenizer's EOS). ``sampling_seed`` makes one request reproducible.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Parse and validate; unknown keys raise ValueError naming the supported ones."""
        data = dict(data or {})
        if "seed" in data:  # a common spelling; SGLang calls it sampling_seed
            data.setdefault("sampling_seed", data.pop("seed"))
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k, v in data.items() if k not in known and v is not None)
        if unknown:
            raise ValueError(
                f"unsupported sampling_params {unknown}; the embedded engine supports "
                f"{sorted(known)}"
            )
        params = cls(**{k: v for k, v in data.items() if k in known and v is not None})
        params.validate()
        return params

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


def finish_reason(kind: str, *, matched: int | str | None = None, **extra: Any) -> dict:
    """``{"type": "stop"|"length"|"abort", ...}`` as SGLang reports it."""
    assert kind in FINISH_TYPES, kind
    reason: dict[str, Any] = {"type": kind}
    if kind == "stop":
        reason["matched"] = matched
    reason.update(extra)
    return reason


def token_logprobs(logprobs: list[float], token_ids: list[int]) -> list[list]:
    """SGLang's ``output_token_logprobs``: ``[logprob, token_id, text]`` per token (text is
    None unless ``return_text_in_logprobs``)."""
    return [[lp, tok, None] for lp, tok in zip(logprobs, token_ids, strict=True)]


def finite_logprobs(values: list[float | None]) -> bool:
    """True when no log-prob in ``values`` is NaN or infinite (None entries aside): such
    values are what :func:`encode_json` may hand to orjson."""
    if None in values:  # a prompt's first token has no log-prob
        values = [value for value in values if value is not None]
    return all(map(math.isfinite, values))


def encode_json(data: Any, *, finite: bool) -> bytes:
    """``data`` as JSON, by orjson when installed and ``finite`` says ``data`` holds no NaN
    or infinity (orjson writes those as null; json as NaN/Infinity, which
    :func:`decode_json` reads back as floats). Both write every float so that it parses
    back to the same value."""
    if orjson is not None and finite:
        return orjson.dumps(data)
    return json.dumps(data).encode()


def decode_json(raw: bytes) -> Any:
    """Parsed JSON bytes: by orjson when installed, by json what orjson refuses (NaN and
    Infinity, integers past 64 bits); not JSON at all raises ``json.JSONDecodeError``."""
    if orjson is not None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def parse_token_logprobs(entries: list[list]) -> tuple[list[float], list[int]]:
    """Inverse of :func:`token_logprobs`: ``(logprobs, token_ids)``."""
    return [float(e[0]) for e in entries], [int(e[1]) for e in entries]


def normalize_prompts(body: dict[str, Any]) -> tuple[list[Any], bool]:
    """The prompts of a /generate body as a list and whether the body was a batch.

    Each prompt is a string (``text``) or a list of ids (``input_ids``).
    """
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("/generate needs exactly one of 'text' or 'input_ids'")
    if text is not None:
        return (list(text), True) if isinstance(text, list) else ([text], False)
    if input_ids and isinstance(input_ids[0], list):
        return [list(map(int, ids)) for ids in input_ids], True
    return [list(map(int, input_ids))], False
