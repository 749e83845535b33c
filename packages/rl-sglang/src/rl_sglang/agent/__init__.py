"""Agentic RL: an OpenAI-compatible gateway that records token-exact trajectories
(:mod:`~rl_sglang.agent.gateway`, :mod:`~rl_sglang.agent.sessions`; token-by-token
streaming in :mod:`~rl_sglang.agent.streaming`, tool-call formats in
:mod:`~rl_sglang.agent.tools`), the agent rollout function
(:mod:`~rl_sglang.agent.rollout`), an external rollout buffer agent workers write into
(:mod:`~rl_sglang.agent.buffer`) and multi-turn SFT loss masks
(:mod:`~rl_sglang.agent.masks`)."""
