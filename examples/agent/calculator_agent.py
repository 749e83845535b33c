"""A tool-using agent written against the OpenAI client: it offers a calculator tool,
runs the calls the model makes, and scores the episode.

rl-train runs it through the agent gateway (``rl_sglang.agent.rollout:generate`` with
``RL_SGLANG_AGENT=calculator_agent:solve`` and this folder on ``PYTHONPATH``; see
README.md). Reward: 0.2 for a valid calculator call, plus 1 when the final answer is the
right number. Set ``AGENT_LOG`` to a file to record each reply's token ids and weight
version (the gateway's ``token_ids`` / ``weight_version`` fields).
"""

import json
import os

import openai

from rl_sglang.rollout.multiturn import calculate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
MAX_TURNS = 2


async def solve(base_url: str, session_id: str, sample) -> float:
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=os.environ.get("RL_SGLANG_API_KEY", "none")
    )
    messages = [{"role": "user", "content": sample.prompt}]
    valid_call = False
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=TOOLS,
            extra_headers={"X-Session-Id": session_id},
        )
        _log(session_id, reply)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments or "{}")
            ok = call.function.name == "calculator" and isinstance(arguments, dict)
            result = (
                calculate(str(arguments.get("expression", ""))) if ok else "error: unknown tool"
            )
            valid_call = valid_call or not result.startswith("error")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = messages[-1].get("content") or ""
    correct = answer.strip() == str(sample.label)  # not "in": "92" would hold "9"
    return 0.2 * valid_call + float(correct)


def _log(session_id: str, reply) -> None:
    path = os.environ.get("AGENT_LOG")
    if path:
        extra = reply.choices[0].model_extra or {}
        record = {
            "session": session_id,
            "token_ids": extra.get("token_ids"),
            "weight_version": extra.get("weight_version"),
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
