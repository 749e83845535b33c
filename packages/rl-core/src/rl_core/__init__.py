"""rl-core: the pure maths of RL post-training for LLMs.

Tensor-in, tensor-out functions with documented shapes and no configs or process groups:
KL estimators (:mod:`rl_core.kl`), policy/value/SFT losses and aggregation
(:mod:`rl_core.losses`), advantage estimators (:mod:`rl_core.advantages`), rollout
importance correction (:mod:`rl_core.importance`), chunked log-probs and entropy
(:mod:`rl_core.logprobs`), packing and partitions (:mod:`rl_core.packing`), context-parallel
layout (:mod:`rl_core.cp`), metrics, dynamic-sampling filters, :class:`Sample`, the packed
:class:`TrainBatch`, registries and the backend protocols.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rl-core")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"
