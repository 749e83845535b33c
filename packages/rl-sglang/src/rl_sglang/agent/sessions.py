"""Per-session trajectory trees: the token ids the engine saw and produced, turn by turn.

Each turn a client sends the whole conversation. :meth:`Session.prompt` finds the longest
recorded turn whose messages are a prefix of it and continues from that turn's exact
token ids (the ids the engine sampled, never a re-tokenisation of their text); only the
messages after it are rendered through the chat template and tokenised, once. A client
that rewrites history matches an earlier turn (or none), so the trajectory forks there;
:meth:`Session.samples` makes one :class:`~rl_core.types.Sample` per leaf whose loss mask
trains only the model's own tokens (prompt, user and tool turns and template glue: 0).

    session = Session(tokenizer)
    turn = session.prompt(messages, tools)        # turn.input_ids go to /generate
    session.record(turn, output, assistant_message)  # output: the engine's /generate reply
    session.samples(template)                     # one Sample per leaf
"""

import json
from dataclasses import dataclass, field
from typing import Any

from rl_core.types import Sample, SampleStatus
from rl_sglang.protocol import parse_token_logprobs

FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


@dataclass
class Node:
    """One recorded turn: the conversation up to and including the model's reply, and the
    token ids of all of it (``mask[i]`` = 1 where the engine sampled ``tokens[i]``)."""

    messages: list[dict]
    tokens: list[int]
    mask: list[int]
    log_probs: list[float]
    versions: list[str]
    prompt_length: int
    status: SampleStatus = SampleStatus.COMPLETED
    turns: int = 1  # model replies on the path to here
    children: int = 0


@dataclass
class Turn:
    """What one request sends to the engine, and where it continues from."""

    messages: list[dict]
    input_ids: list[int]
    parent: Node | None
    mask: list[int] = field(default_factory=list)  # over input_ids
    log_probs: list[float] = field(default_factory=list)


def normalise(message: Any) -> dict:
    """The parts of a chat message that decide whether two histories are the same (an
    echoed assistant message carries extra ``None`` fields; arguments compare as JSON)."""
    message = dict(message)
    calls = [
        (c["function"]["name"], _arguments(c["function"].get("arguments")), c.get("id"))
        for c in message.get("tool_calls") or []
    ]
    return {
        "role": message.get("role"),
        "content": message.get("content") or "",
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: tool-call arguments as mappings."""
    out = []
    for message in messages:
        message = {k: v for k, v in dict(message).items() if v is not None}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": _arguments(c["function"].get("arguments")),
                    },
                }
                for c in message["tool_calls"]
            ]
        out.append(message)
    return out


class Session:
    """One agent episode's trajectory tree (see the module docstring). ``end_token_id``
    ends a model turn in the chat template (default: the tokenizer's EOS)."""

    def __init__(self, tokenizer, *, end_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.end_token_id = tokenizer.eos_token_id if end_token_id is None else end_token_id
        self.nodes: list[Node] = []
        self.forks = 0

    def render(self, messages: list[dict], tools, *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            for_template(messages),
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict], tools=None) -> Turn:
        """The token ids of ``messages`` plus the generation prompt, continuing the longest
        recorded turn they extend (its ids kept exactly), or rendered afresh."""
        if not messages:
            raise ValueError("messages is empty: send at least one user message")
        parent = self._longest_prefix(messages)
        full = self.render(messages, tools, generation_prompt=True)
        if parent is not None:
            before = self.render(parent.messages, tools, generation_prompt=False)
            if full.startswith(before):
                suffix = self._glue(parent, tools) + full[len(before) :]
                ids = self.encode(suffix)
                return Turn(
                    messages,
                    parent.tokens + ids,
                    parent,
                    parent.mask + [0] * len(ids),
                    parent.log_probs + [0.0] * len(ids),
                )
            parent = None  # the template re-renders history differently: start afresh
        ids = self.encode(full)
        return Turn(messages, ids, None, [0] * len(ids), [0.0] * len(ids))

    def _glue(self, parent: Node, tools) -> str:
        """What the template writes after the model's end-of-turn token (e.g. ChatML's
        newline), or the end-of-turn itself when the engine stopped without it."""
        turn = self.render(parent.messages, tools, generation_prompt=False)
        end = self.tokenizer.decode([self.end_token_id])
        at = turn.rfind(end)
        if at < 0:
            return ""
        ended = parent.tokens and parent.tokens[-1] == self.end_token_id
        return turn[at + len(end) :] if ended else turn[at:]

    def _longest_prefix(self, messages: list[dict]) -> Node | None:
        wanted = [normalise(m) for m in messages]
        best = None
        for node in self.nodes:
            n = len(node.messages)
            longer = best is None or n > len(best.messages)
            if longer and n < len(wanted) and [normalise(m) for m in node.messages] == wanted[:n]:
                best = node
        return best

    def record(self, turn: Turn, output: dict, assistant: dict) -> Node:
        """Append the engine's ``output`` (ids, log-probs, weight version) as the reply
        ``assistant`` to ``turn``; a parent already continued once forks here."""
        meta = output["meta_info"]
        log_probs, ids = parse_token_logprobs(meta.get("output_token_logprobs", []))
        out_ids = list(output["output_ids"])
        if ids and ids != out_ids:
            raise ValueError("output_token_logprobs do not match output_ids")
        version = str(meta.get("weight_version", ""))
        parent = turn.parent
        versions = list(parent.versions) if parent else []
        if out_ids and (not versions or versions[-1] != version):
            versions.append(version)
        prompt_length = parent.prompt_length if parent else len(turn.input_ids)
        node = Node(
            messages=[*turn.messages, assistant],
            tokens=turn.input_ids + out_ids,
            mask=turn.mask + [1] * len(out_ids),
            log_probs=turn.log_probs + (log_probs or [0.0] * len(out_ids)),
            versions=versions,
            prompt_length=prompt_length,
            status=FINISH_STATUS[meta["finish_reason"]["type"]],
            turns=parent.turns + 1 if parent else 1,
        )
        if parent is not None:
            self.forks += parent.children > 0
            parent.children += 1
        self.nodes.append(node)
        return node

    def leaves(self) -> list[Node]:
        return [node for node in self.nodes if node.children == 0]

    def samples(self, template: Sample | None = None) -> list[Sample]:
        """One Sample per leaf: ``tokens`` the exact ids, the loss mask 1 only on sampled
        ids, log-probs the engine's (0 elsewhere), the weight versions that produced it."""
        template = template or Sample(prompt="")
        out = []
        for number, leaf in enumerate(self.leaves()):
            p = leaf.prompt_length
            sample = Sample.from_dict(template.to_dict())
            sample.tokens, sample.response_length = list(leaf.tokens), len(leaf.tokens) - p
            sample.loss_mask, sample.rollout_log_probs = leaf.mask[p:], leaf.log_probs[p:]
            sample.weight_versions, sample.status = list(leaf.versions), leaf.status
            sample.response = self.tokenizer.decode(leaf.tokens[p:])
            sample.metadata.update(leaf=number, turns=leaf.turns, messages=leaf.messages)
            out.append(sample)
        return out
