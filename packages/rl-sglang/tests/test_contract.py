"""Pins the request/response field names we use to SGLang's schema.

The sets below are SGLang's own field names (python/sglang/srt/managers/io_struct.py:
GenerateReqInput, UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput; sampling params
from sampling_params.py; meta_info from the tokenizer manager's /generate output), written
out here so a rename on either side fails this test.
"""

import asyncio
import json
import math

import pytest

from rl_sglang import protocol
from rl_sglang.engine.core import Engine, load_model

SGLANG_GENERATE_REQ = {
    "rid",
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "log_metrics",
    "return_hidden_states",
    "session_params",
    "lora_path",
    "custom_logit_processor",
}
SGLANG_SAMPLING = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "regex",
    "json_schema",
    "ebnf",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}
SGLANG_META_INFO = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
    "weight_version",
    "output_token_logprobs",
    "input_token_logprobs",
}
SGLANG_UPDATE_DISK = {"model_path", "load_format", "abort_all_requests", "weight_version"}
SGLANG_UPDATE_TENSOR = {
    "serialized_named_tensors",
    "load_format",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
}
SGLANG_INIT_GROUP = {
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "group_name",
    "backend",
}
SGLANG_UPDATE_DIST = {
    "names",
    "dtypes",
    "shapes",
    "group_name",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
}


def test_our_field_names_are_sglang_field_names():
    assert set(protocol.GENERATE_FIELDS) <= SGLANG_GENERATE_REQ
    assert set(protocol.META_INFO_FIELDS) <= SGLANG_META_INFO
    assert {
        f.name for f in protocol.SamplingParams.__dataclass_fields__.values()
    } <= SGLANG_SAMPLING
    assert set(protocol.UPDATE_FROM_DISK_FIELDS) == SGLANG_UPDATE_DISK
    assert set(protocol.UPDATE_FROM_TENSOR_FIELDS) == SGLANG_UPDATE_TENSOR
    assert set(protocol.INIT_GROUP_FIELDS) == SGLANG_INIT_GROUP
    assert set(protocol.UPDATE_FROM_DISTRIBUTED_FIELDS) == SGLANG_UPDATE_DIST
    assert protocol.FINISH_TYPES == ("stop", "length", "abort")


def test_sampling_params_parse_like_sglang():
    params = protocol.SamplingParams.from_dict({"stop": "x", "seed": 3, "top_k": None})
    assert params.stop == ["x"] and params.sampling_seed == 3 and params.top_k == -1
    with pytest.raises(ValueError, match="regex"):
        protocol.SamplingParams.from_dict({"regex": "a+"})


def test_finish_reason_and_logprob_shapes():
    assert protocol.finish_reason("stop", matched=7) == {"type": "stop", "matched": 7}
    assert protocol.finish_reason("length", length=3) == {"type": "length", "length": 3}
    entries = protocol.token_logprobs([-0.5, -1.0], [4, 9])
    assert entries == [[-0.5, 4, None], [-1.0, 9, None]]
    assert protocol.parse_token_logprobs(entries) == ([-0.5, -1.0], [4, 9])


def test_prompt_normalisation():
    assert protocol.normalize_prompts({"text": "hi"}) == (["hi"], False)
    assert protocol.normalize_prompts({"input_ids": [[1], [2, 3]]}) == ([[1], [2, 3]], True)
    with pytest.raises(ValueError, match="exactly one"):
        protocol.normalize_prompts({"text": "a", "input_ids": [1]})


def test_embedded_response_has_exactly_the_pinned_meta_info(tiny_dir):
    model, tokenizer = load_model(str(tiny_dir))
    engine = Engine(model, tokenizer, model_path=str(tiny_dir))
    try:
        groups, _ = engine.make_requests(
            {"text": "hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
        )
        out = asyncio.run(engine.run(groups[0]))[0]
    finally:
        engine.scheduler.stop()
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert set(out["meta_info"]) == set(protocol.META_INFO_FIELDS) | {"output_token_logprobs"}
    assert out["meta_info"]["prompt_tokens"] == 2  # "hi" is two byte tokens


def test_json_codec_reads_back_what_json_would():
    from rl_sglang.engine.request import Request

    request = Request(rid="r", parent_rid="r", prompt_ids=[1, 2], params=protocol.SamplingParams())
    request.return_logprob, request.output_ids = True, [3, 4, 5]
    request.output_logprobs = [-0.1, -1e-300, -123.456789012345]
    request.finish = protocol.finish_reason("stop", matched=5)
    response = request.response()
    assert request.finite()
    encoded = protocol.encode_json(response, finite=True)
    assert protocol.decode_json(encoded) == json.loads(json.dumps(response))
    assert protocol.decode_json(json.dumps(response).encode()) == response


def test_json_codec_keeps_non_finite_log_probs():
    # orjson writes NaN and infinities as null: such responses go through json, and what
    # json writes (-Infinity, NaN) is read back as floats
    from rl_sglang.engine.request import Request

    request = Request(rid="r", parent_rid="r", prompt_ids=[1, 2], params=protocol.SamplingParams())
    request.return_logprob, request.output_ids = True, [3, 4]
    request.output_logprobs = [-0.5, float("-inf")]
    request.input_logprobs = [None, -2.0]
    request.finish = protocol.finish_reason("length")
    assert not request.finite()
    response = request.response()
    decoded = protocol.decode_json(protocol.encode_json(response, finite=request.finite()))
    assert decoded["meta_info"]["output_token_logprobs"] == [[-0.5, 3, None], [-math.inf, 4, None]]
    assert math.isnan(protocol.decode_json(b'{"x": NaN}')["x"])
    request.output_logprobs = [-0.5, -0.25]  # a prompt's leading None is no infinity
    assert request.finite()
    with pytest.raises(json.JSONDecodeError):
        protocol.decode_json(b"Cache flushed.")
