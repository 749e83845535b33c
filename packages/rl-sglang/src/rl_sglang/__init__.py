"""rl-sglang: rollout engines (SGLang or the embedded HF engine), sglang-router, weight-update
transports and rollout functions, all over SGLang's native HTTP API.

Modules: :mod:`rl_sglang.protocol` (field names, sampling params), :mod:`rl_sglang.client`,
:mod:`rl_sglang.process` (engine processes), :mod:`rl_sglang.router`,
:mod:`rl_sglang.transports` (trainer side of weight updates), :mod:`rl_sglang.embedded`
and :mod:`rl_sglang.engine` (the embedded engine), :mod:`rl_sglang.rollout`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rl-sglang")
except PackageNotFoundError:
    __version__ = "0.0.0"
