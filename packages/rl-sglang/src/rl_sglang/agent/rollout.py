"""The agent rollout: each sample is one episode of a user's agent talking to the policy
through the gateway (:mod:`~rl_sglang.agent.gateway`), with the OpenAI API.

The agent is ``async def agent(base_url, session_id, sample) -> float``: it sends its
chat requests to ``base_url`` with the ``X-Session-Id`` header (or ``user``) set to
``session_id``, may read the task from ``sample.prompt`` / ``sample.label``, and returns
the episode's reward. Make a generate function of it, in a module of yours::

    generate = AgentRollout("my_pkg.agents:solve")   # rollout.function: my_pkg.agents:generate

or use ``rl_sglang.agent.rollout:generate`` with ``RL_SGLANG_AGENT=my_pkg.agents:solve``
(and ``RL_SGLANG_TOOL_PARSER=hermes|llama3_json`` where the chat template does not imply
the tool-call format; ``AgentRollout(..., tool_parser=)``).
Each call starts the gateway on the rollout's event loop if it is not up yet (loopback,
a free port), runs one episode under the rollout's sampling params, and returns one
Sample per leaf of the episode's trajectory tree (:mod:`~rl_sglang.agent.sessions`). The
episode's reward travels as the samples' label ``{"agent_reward": r}`` (the task's own
label kept in ``metadata["label"]``), so the reward :func:`agent_reward` (rl-train:
``rollout.reward: rl_sglang.agent.rollout:agent_reward``) hands it to training.
"""

import asyncio
import os
import uuid

from rl_core.types import Sample, SampleStatus
from rl_sglang.agent.gateway import Gateway
from rl_sglang.rollout.generate import GenerateContext, load_function, seeded

AGENT_ENV = "RL_SGLANG_AGENT"
TOOL_PARSER_ENV = "RL_SGLANG_TOOL_PARSER"


class AgentRollout:
    """A generate function running the agent ``agent`` (a dotted path or the function);
    ``tool_parser`` names the gateway's tool-call format (None: ``RL_SGLANG_TOOL_PARSER``,
    else the one the chat template writes)."""

    def __init__(self, agent, *, api_key: str | None = None, tool_parser: str | None = None):
        self.agent, self.api_key, self.tool_parser = agent, api_key, tool_parser
        self.gateway: Gateway | None = None
        self._started = None  # the start, awaited by every episode (they begin together)

    async def _gateway(self, ctx: GenerateContext) -> Gateway:
        if self.gateway is None:
            if ctx.tokenizer is None:
                raise ValueError("the agent rollout needs GenerateContext.tokenizer")
            parser = self.tool_parser or os.environ.get(TOOL_PARSER_ENV) or None
            self.gateway = Gateway(
                ctx.client, ctx.tokenizer, api_key=self.api_key, tool_parser=parser
            )
            self._started = asyncio.ensure_future(self.gateway.start())
        await self._started
        return self.gateway

    def _agent(self):
        agent = self.agent or os.environ.get(AGENT_ENV)
        if not agent:
            raise ValueError(
                f"no agent: pass AgentRollout('pkg.mod:fn') or set {AGENT_ENV}=pkg.mod:fn"
            )
        return load_function(agent) if isinstance(agent, str) else agent

    async def __call__(
        self, ctx: GenerateContext, sample: Sample, sampling_params: dict
    ) -> list[Sample]:
        gateway, agent = await self._gateway(ctx), self._agent()
        session_id = f"{sample.metadata.get('rid') or uuid.uuid4().hex}"
        gateway.open(session_id, seeded(sampling_params, sample))
        try:
            reward = float(await agent(gateway.url, session_id, sample))
        finally:
            samples = gateway.close(session_id, sample)
        if not samples:  # the agent never asked the model: nothing to train on
            sample.status = SampleStatus.ABORTED
            sample.metadata["error"] = "the agent made no chat request in its session"
            return sample
        for leaf in samples:
            leaf.metadata["label"], leaf.label = sample.label, {"agent_reward": reward}
            leaf.reward = reward
        return samples


def agent_reward(response: str, label) -> float:
    """The reward the episode's agent returned (see the module docstring)."""
    if not isinstance(label, dict) or "agent_reward" not in label:
        raise ValueError(
            "agent_reward scores samples of the agent rollout only (label "
            "{'agent_reward': r}); set rollout.function to an AgentRollout"
        )
    return float(label["agent_reward"])


generate = AgentRollout(None)
