"""A multi-turn tool-calling generate function: the model writes ``<calc>EXPR</calc>``, the
calculator's answer is appended as ``<result>VALUE</result>``, and generation goes on.

Token-in/token-out: every turn sends the exact token ids so far (``input_ids``) and appends
the engine's ``output_ids``; tool outputs are tokenised once and appended with loss mask 0
and log-prob 0, so training never sees a re-tokenisation of model text.

Use by dotted path: ``RolloutConfig(generate_fn="rl_sglang.rollout.multiturn:generate_with_calculator")``.
"""

import ast
import operator
import re

from rl_core.types import Sample, SampleStatus
from rl_sglang.detokenize import text_decoder
from rl_sglang.rollout.generate import GenerateContext, append_response, remaining_budget

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> str:
    """Evaluate + - * / ** and parentheses over numbers; errors come back as text."""
    try:
        return _format(_eval(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as error:
        return f"error: {type(error).__name__}"


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        if isinstance(node.op, ast.Pow) and abs(_eval(node.right)) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression {ast.dump(node)[:40]}")


def _format(value) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class CalculatorTool:
    """The tool loop. A call ends when the engine stops on ``call_end`` (a stop string or
    a stop token id); the expression is the text after the last ``<calc>`` of that turn."""

    def __init__(self, *, call_end: str | int = "</calc>", max_turns: int = 4):
        self.call_end, self.max_turns = call_end, max_turns

    def _stop_params(self, sampling_params: dict) -> dict:
        key = "stop" if isinstance(self.call_end, str) else "stop_token_ids"
        return {**sampling_params, key: [*sampling_params.get(key, []), self.call_end]}

    async def __call__(self, ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
        if ctx.tokenizer is None:
            raise ValueError("the calculator tool needs GenerateContext.tokenizer")
        sample.tokens = sample.tokens or ctx.prompt_ids(sample)
        params = self._stop_params(sampling_params)
        for turn in range(self.max_turns):
            budget = remaining_budget(sample, params)
            output = await ctx.client.generate(
                input_ids=sample.tokens,
                sampling_params=budget,
                return_logprob=True,
                **ctx.route_fields(),
            )
            # each turn's routes cover the whole context so far (tool output included)
            append_response(sample, output, routed_experts_shape=ctx.routed_experts_shape)
            reason = output["meta_info"]["finish_reason"]
            if reason["type"] != "stop" or reason.get("matched") != self.call_end:
                break
            self._append_tool_output(ctx, sample, output["output_ids"])
            sample.metadata["tool_calls"] = turn + 1
            if sample.response_length >= int(sampling_params.get("max_new_tokens", 128)):
                sample.status = SampleStatus.TRUNCATED
                break
        sample.response = text_decoder(ctx.tokenizer)(sample.tokens[sample.prompt_length :])
        return sample

    def _append_tool_output(
        self, ctx: GenerateContext, sample: Sample, turn_ids: list[int]
    ) -> None:
        text = ctx.tokenizer.decode(turn_ids)
        match = re.findall(r"<calc>(.*?)(?:</calc>|$)", text, flags=re.S)
        result = calculate(match[-1]) if match else "error: no <calc> expression"
        tool_ids = ctx.tokenizer.encode(f"<result>{result}</result>")
        sample.tokens.extend(tool_ids)
        sample.response_length += len(tool_ids)
        sample.loss_mask = sample.effective_loss_mask()[
            : sample.response_length - len(tool_ids)
        ] + [0] * len(tool_ids)
        sample.rollout_log_probs = (sample.rollout_log_probs or []) + [0.0] * len(tool_ids)
        sample.metadata.setdefault("tool_results", []).append(result)


generate_with_calculator = CalculatorTool()
