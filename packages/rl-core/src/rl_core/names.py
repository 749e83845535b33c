"""The names rl-core's algorithms are picked by, importable without torch.

A launcher checks a config's names (advantage estimator, policy loss, aggregation mode,
KL estimator, ...) before anything starts, and importing torch to do so costs 1-2 s on a
small CPU. The registries and option lists live here; the modules that implement them
(:mod:`rl_core.advantages`, :mod:`rl_core.losses`, ...) re-export them, so
``rl_core.losses.POLICY_LOSSES`` is this very registry. A registry's built-in entries are
registered by its ``home`` module, imported on the first :meth:`Registry.get` of one of
them (tests/test_names.py checks that the names declared here are the ones registered).
"""

from rl_core.registry import CallShape, Registry, is_dotted, load_checked

ADVANTAGE_SHAPE = CallShape(
    1, (), "fn(inputs: rl_core.advantages.AdvantageInputs) -> (advantages [B, T], returns [B, T])"
)
ADVANTAGE_ESTIMATORS = Registry(
    "advantage estimator",
    ADVANTAGE_SHAPE,
    home="rl_core.advantages",
    builtins=(
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "gae",
    ),
)

# fn(log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, cu_seqlens)
POLICY_LOSS_SHAPE = CallShape(
    4,
    ("clip_low", "clip_high", "dual_clip", "cu_seqlens"),
    "fn(log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, "
    "cu_seqlens) -> (per_token_loss, clipped): per-token tensors shaped like log_probs",
)
POLICY_LOSSES = Registry(
    "policy loss", POLICY_LOSS_SHAPE, home="rl_core.losses", builtins=("ppo", "gspo", "cispo")
)

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# A custom reducer (a dotted path given as ``mode``) is called as aggregate is, less ``mode``.
REDUCER_SHAPE = CallShape(
    2,
    ("cu_seqlens", "num_tokens", "num_seqs", "norm_length"),
    "fn(per_token, mask, *, cu_seqlens, num_tokens, num_seqs, norm_length) -> scalar tensor "
    "(divide by the global num_tokens / num_seqs, so micro-batches and ranks add up)",
)

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")  # rl_core.kl
IS_LEVELS = ("token", "sequence")  # rl_core.importance
IS_MODES = ("truncate", "mask")
PREFERENCE_LOSSES = ("sigmoid", "ipo")  # rl_core.preference


def load_reducer(mode: str):
    """The built-in ``mode`` name as is, or the custom reducer at the dotted path ``mode``
    (imported and its signature checked); ValueError naming the known modes otherwise."""
    if is_dotted(mode):
        return load_checked(mode, REDUCER_SHAPE, "loss aggregation")
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown aggregation mode {mode!r}; choose one of: {', '.join(AGGREGATION_MODES)} "
            "or a dotted path 'pkg.module:function'"
        )
    return mode
