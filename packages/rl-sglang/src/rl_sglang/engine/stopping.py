"""When a request stops: stop token ids, EOS, stop strings, the token budget, the context."""

from typing import NamedTuple

from rl_sglang.detokenize import text_decoder
from rl_sglang.engine.request import Request
from rl_sglang.protocol import finish_reason


class StopRule(NamedTuple):
    """What ends one request, worked out once: the token ids that stop it (its stop ids,
    and EOS unless ``ignore_eos``), whether it has stop strings, and the response length
    at which it stops (its token budget or the context, whichever comes first)."""

    token_ids: frozenset
    strings: bool
    length: int


class StopChecker:
    """Decides, after each new token, whether a request is done, and its final text."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_context: int):
        self.tokenizer = tokenizer
        # the text tokenizer.decode gives, through the Rust backend where that is the same:
        # every finished request is decoded on the scheduler thread
        self._decode = None if tokenizer is None else text_decoder(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context

    def rule(self, request: Request) -> StopRule:
        if request.stop_rule is None:
            params = request.params
            ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                ids |= self.eos_token_ids
            length = min(params.max_new_tokens, self.max_context - len(request.prompt_ids))
            strings = bool(params.stop) and self.tokenizer is not None
            request.stop_rule = StopRule(frozenset(ids), strings, length)
        return request.stop_rule

    def check(self, request: Request) -> dict | None:
        """The finish reason if the last token ended ``request``, else None."""
        rule, output = self.rule(request), request.output_ids
        if output[-1] in rule.token_ids:
            return finish_reason("stop", matched=output[-1])
        if rule.strings:
            matched = self._stop_string(request)
            if matched is not None:
                return finish_reason("stop", matched=matched)
        if len(output) >= rule.length:
            return finish_reason("length", length=len(output))
        return None

    def _stop_string(self, request: Request) -> str | None:
        longest = max(len(s) for s in request.params.stop)
        tail = self.decode(request.output_ids[-(longest + 8) :], request)
        return next((s for s in request.params.stop if s in tail), None)

    def decode(self, token_ids: list[int], request: Request) -> str:
        if self._decode is None:
            return ""
        return self._decode(token_ids, skip_special_tokens=request.params.skip_special_tokens)

    def final_text(self, request: Request, reason: dict) -> str:
        """Decoded output; a matched stop string or stop token is trimmed like SGLang does."""
        params = request.params
        ids = request.output_ids
        matched = reason.get("matched")
        trim = reason.get("type") == "stop" and not params.no_stop_trim
        if trim and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.decode(ids, request)
        if trim and isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text
