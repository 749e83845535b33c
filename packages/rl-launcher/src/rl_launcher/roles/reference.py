"""The frozen reference model's part of a step: its log-probs of the step's batch, for the
KL in the loss (``algorithm.kl_coef``) and for the KL-shaped reward
(``algorithm.reward_kl_coef``). The backends load the reference when either is > 0
(``rl_core.objective.Objective.needs_reference``); with neither, a step never calls it.

    rank_batches = with_old_log_probs(step.rank_batches, old)       # trainer, "actor"
    rank_batches = with_reference(run, buffer, step, rank_batches)  # trainer, "ref"

The reward's KL uses the old log-probs (the policy that generated the step, as the
trainer sees it) against the reference's, one estimate per response token (verl's
``use_kl_in_reward`` and slime's ``--kl-coef`` do the same); the buffer turns it into the
advantages it left empty (:meth:`rl_launcher.data.buffer.DataBuffer.fill_advantages`).
"""

from dataclasses import replace


def with_reference(run, buffer, step, rank_batches: list) -> list:
    """``rank_batches`` (with old log-probs) with what the reference adds: ``ref_log_probs``
    for the loss's KL, the advantages of a KL-shaped reward; unchanged when neither is on."""
    use_in_loss = run.config.algorithm.kl_coef > 0
    if not use_in_loss and not buffer.defers_advantages:
        return rank_batches
    ref = run.trainer.log_probs(rank_batches, model="ref")
    if use_in_loss:
        rank_batches = [replace(b, ref_log_probs=r) for b, r in zip(rank_batches, ref, strict=True)]
    if buffer.defers_advantages:
        rank_batches = buffer.fill_advantages(step, rank_batches, ref)
    return rank_batches
