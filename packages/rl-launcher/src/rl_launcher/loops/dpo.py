"""``mode=dpo``: direct preference optimisation on offline pairs, through the SFT loop
(:func:`rl_launcher.loops.sft.train_sft`: same start-up, checkpoints, resume, progress)
with its own step and row reader. Each step reads like the algorithm:

    pairs (prompt, chosen, rejected)  ->  2 sequences each, chosen first, pairs kept
    whole on one rank  ->  reference log-probs (frozen starting model, once per batch)
    ->  one optimizer step of rl-fsdp's "dpo" objective (rl_core.preference)

Metrics: ``pref/loss``, ``pref/accuracy`` (implicit reward of chosen above rejected),
``pref/margin``, ``pref/chosen_reward``, ``pref/rejected_reward`` of the step's pairs
before its update, ``dpo/*`` lengths, ``time/*``.
"""

from dataclasses import replace
from pathlib import Path

from rl_core.batch import batch_from_samples
from rl_core.metrics import summarize
from rl_core.packing import balanced_partitions
from rl_launcher.data.preference import pair_sample_from_row, pair_sequences
from rl_launcher.loops.sft import train_sft
from rl_launcher.loops.step import Clock


def train_dpo(config) -> Path:
    """Run a DPO ``config`` to its last step; returns the run directory."""
    return train_sft(config, step_fn=dpo_step, to_sample=pair_sample_from_row)


def pair_rank_batches(pairs: list, num_ranks: int) -> list:
    """One packed batch of every pair's two sequences (step-wide denominators: ``2P``
    sequences), split across ranks by tokens with each pair whole on one rank."""
    batch = batch_from_samples([seq for pair in pairs for seq in pair_sequences(pair)])
    if num_ranks == 1:
        return [batch]
    sizes = [len(p.tokens) + len(p.metadata["rejected_ids"]) for p in pairs]
    parts = balanced_partitions(sizes, num_ranks)
    return [batch.select([i for p in sorted(part) for i in (2 * p, 2 * p + 1)]) for part in parts]


def dpo_step(run, step: int = 0) -> dict[str, float]:
    config, clock = run.config, Clock()
    pairs = run.source.next_batch(config.rollout.batch_size)
    batches = pair_rank_batches(pairs, run.num_ranks)
    clock.lap("data")
    ref = run.trainer.log_probs(batches, model="ref")
    batches = [replace(b, ref_log_probs=r) for b, r in zip(batches, ref, strict=True)]
    clock.lap("ref_log_probs")
    metrics = run.trainer.train_steps([batches])
    clock.lap("train")
    metrics |= summarize([p.response_length for p in pairs], "dpo/chosen_length")
    metrics |= summarize([len(p.metadata["rejected_ids"]) for p in pairs], "dpo/rejected_length")
    return metrics | clock.times()
