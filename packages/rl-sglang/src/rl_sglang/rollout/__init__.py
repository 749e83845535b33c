"""Rollout functions: :mod:`~rl_sglang.rollout.generate` (the per-sample generate function
and its context), :mod:`~rl_sglang.rollout.default` (dynamic sampling, partial rollout),
:mod:`~rl_sglang.rollout.eval` (pass@k) and :mod:`~rl_sglang.rollout.multiturn` (a tool loop)."""
