"""The embedded engine: :mod:`~rl_sglang.engine.core` (the Engine facade and model loading),
:mod:`~rl_sglang.engine.scheduler` (continuous batching on one thread),
:mod:`~rl_sglang.engine.runner` (dynamic left-padded KV cache) and
:mod:`~rl_sglang.engine.static` (slot KV cache, CUDA graphs), :mod:`~rl_sglang.engine.sampling`,
:mod:`~rl_sglang.engine.stopping`, :mod:`~rl_sglang.engine.weights` (weight updates)."""
