"""The train phase of an RL step, around the policy update, as slime's algorithm switches
shape it (each a one-line call in :func:`rl_launcher.loops.rl.run_step`):

- :func:`with_old_policy`: the PPO ratio's old log-probs per ``algorithm.old_log_probs``:
  recomputed by the trainer, left to the train step's own forward, or the engine's
  sampled ones (``rollout``, slime's ``--use-rollout-logprobs``: no trainer pass);
- :func:`train_policy`: the policy's update, skipped for ``algorithm.critic_warmup_steps``
  (slime's ``--num-critic-only-steps``: only the critic learns then);
- :func:`refresh_reference`: the KL reference becomes the policy every
  ``algorithm.ref_update_interval`` steps (slime's ``--ref-update-interval``); the
  backends keep a refreshed reference in their checkpoints, so ``--resume`` continues with
  the same one (:func:`restore_reference` handles checkpoints from before);
- :func:`dump_train_batches`: ``logging.dump_train_batch`` writes what each rank trained on
  (slime's ``--save-debug-train-data``).

``algorithm.max_logprob_gap`` is a fault rule: :func:`rl_launcher.infra.faults.check_logprob_gap`.
"""

import dataclasses
import sys
from pathlib import Path

import torch

from rl_launcher.roles.train_group import with_old_log_probs

TRAIN_BATCH_DIR = "train_batches"
REFERENCE_SAVED = "reference_saved"  # state.json: the trainer's checkpoint holds the reference


def with_old_policy(run, rank_batches: list) -> list:
    """``rank_batches`` with the old log-probs ``algorithm.old_log_probs`` asks for
    (``train_step``: none; the step's forward supplies them)."""
    source = run.config.algorithm.old_log_probs
    if source == "recompute":
        return with_old_log_probs(rank_batches, run.trainer.log_probs(rank_batches))
    if source == "rollout":
        if any(b.rollout_log_probs is None for b in rank_batches):
            raise ValueError(
                "algorithm.old_log_probs=rollout needs the engine's log-probs of every sample, "
                "and this step's samples came without them (a custom rollout function or "
                "buffer worker that drops them?); use algorithm.old_log_probs=recompute"
            )
        return [dataclasses.replace(b, old_log_probs=b.rollout_log_probs) for b in rank_batches]
    return rank_batches


def train_policy(run, step: int, parts: list) -> dict[str, float]:
    """The policy's optimizer steps on ``parts``, unless ``step`` is one of the first
    ``algorithm.critic_warmup_steps`` (then ``actor/frozen_for_critic_warmup`` is 1)."""
    if step <= run.config.algorithm.critic_warmup_steps:
        return {"actor/frozen_for_critic_warmup": 1.0}
    return run.trainer.train_steps(parts)


def refresh_reference(run, step: int) -> dict[str, float]:
    """After every ``algorithm.ref_update_interval``-th step, the policy's weights become
    the KL reference's (``actor/ref_updated`` 1 on those steps)."""
    interval = run.config.algorithm.ref_update_interval
    if not interval or step % interval:
        return {}
    run.trainer.update_reference()
    return {"actor/ref_updated": 1.0}


def restore_reference(run, found: tuple[Path, dict] | None) -> None:
    """After ``--resume`` from ``found`` (a checkpoint and its state): the backends saved a
    refreshed reference with the trainer and loaded it back, so the reference is the
    uninterrupted run's. A checkpoint written before they did (no ``reference_saved`` in
    its state) gets the resumed policy as its reference, as rl-train did then."""
    interval = run.config.algorithm.ref_update_interval
    if found is None or not interval:
        return
    path, state = found
    if state.get(REFERENCE_SAVED) or int(state["step"]) < interval:
        return  # loaded with the trainer, or still the starting one (or ref_path)
    run.trainer.update_reference()
    print(
        f"rl-train: {path} predates saved KL references: the reference is the policy of "
        f"step {state['step']}, not of step {int(state['step']) // interval * interval}",
        file=sys.stderr,
        flush=True,
    )


def dump_train_batches(run, step: int, rank_batches: list) -> None:
    """``logging.dump_train_batch``: step ``step``'s batches, one per data-parallel rank,
    as trained (every tensor field, on the host) to
    ``<run_dir>/train_batches/step_<step>.pt`` (a list of dicts; ``torch.load``)."""
    if not run.config.logging.dump_train_batch:
        return
    directory = Path(run.config.logging.run_dir) / TRAIN_BATCH_DIR
    directory.mkdir(parents=True, exist_ok=True)
    batches = [train_batch_dict(b) for b in rank_batches]
    path = directory / f"step_{step:06d}.pt"
    torch.save({"step": step, "rank_batches": batches}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # whole files only


def train_batch_dict(batch) -> dict:
    """A TrainBatch's fields as plain values: tensors on the host, numbers as they are."""
    out = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, torch.Tensor):
            out[field.name] = value.detach().cpu()
        elif isinstance(value, (int, float)) or value is None:
            out[field.name] = value
    return out
