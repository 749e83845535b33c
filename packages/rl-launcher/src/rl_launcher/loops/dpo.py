"""``mode=dpo``: direct preference optimisation on offline pairs, through the SFT loop
(:func:`rl_launcher.loops.sft.train_sft`: same start-up, checkpoints, resume, progress)
with its own step and row reader. Each step reads like the algorithm:

    pairs (prompt, chosen, rejected)  ->  2 sequences each, chosen first, pairs kept
    whole on one rank  ->  reference log-probs (frozen starting model, once per batch)
    ->  one optimizer step of rl-fsdp's "dpo" objective (rl_core.preference)

Metrics: ``pref/loss``, ``pref/accuracy`` (implicit reward of chosen above rejected),
``pref/margin``, ``pref/chosen_reward``, ``pref/rejected_reward`` of the step's pairs
before its update, ``dpo/*`` lengths, ``time/*``. With ``eval.datasets`` (pair rows) and
``eval.interval``, every interval and at the last step the same ``pref/*`` metrics of
every held-out pair, after the step's update: ``eval/<name>/pref/*`` (no training).
"""

from dataclasses import replace
from pathlib import Path

from rl_core.batch import batch_from_samples
from rl_core.metrics import summarize
from rl_core.packing import balanced_partitions
from rl_core.preference import packed_pair_loss
from rl_launcher.data.preference import pair_sample_from_row, pair_sequences
from rl_launcher.data.sft import load_sft_dataset
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
    interval = config.eval.interval
    if interval and (step % interval == 0 or step == config.num_steps):
        metrics |= evaluate_pairs(run)
        clock.lap("eval")
    return metrics | clock.times()


def evaluate_pairs(run) -> dict[str, float]:
    """``eval/<name>/pref/*`` of every pair of each ``eval.datasets`` entry: the policy's
    and the reference's log-probs, then rl-core's DPO metrics over all the pairs."""
    config, metrics = run.config, {}
    for dataset in eval_datasets(run):
        pairs = dataset.prompts
        batches = pair_rank_batches(pairs, run.num_ranks)
        policy = run.trainer.log_probs(batches)
        ref = run.trainer.log_probs(batches, model="ref")
        for batch, actor, reference in zip(batches, policy, ref, strict=True):
            _, shares = packed_pair_loss(
                log_probs=actor,
                ref_log_probs=reference,
                mask=batch.loss_mask,
                cu_seqlens=batch.cu_seqlens,
                num_pairs=len(pairs),
                beta=config.algorithm.dpo_beta,
                kind=config.algorithm.dpo_loss,
                label_smoothing=config.algorithm.dpo_label_smoothing,
            )
            for key, share in shares.items():  # each rank's share of the mean over all pairs
                name = f"eval/{dataset.name}/{key}"
                metrics[name] = metrics.get(name, 0.0) + share
    return metrics


def eval_datasets(run) -> list:
    """The held-out pair datasets, read once (kept in ``run.extras``)."""
    if "dpo_eval" not in run.extras:
        config = run.config
        run.extras["dpo_eval"] = [
            load_sft_dataset(
                spec,
                config.data,
                tokenizer=run.extras["tokenizer"],
                max_response_tokens=config.rollout.max_response_tokens,
                to_sample=pair_sample_from_row,
            )
            for spec in config.eval.datasets
        ]
    return run.extras["dpo_eval"]
