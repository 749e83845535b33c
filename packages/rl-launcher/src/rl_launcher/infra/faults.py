"""Training faults that stop a run, each with a message naming what failed and the last
complete checkpoint to continue from (``rl-train ... --resume``):

- non-finite steps: a backend skips an update whose loss or gradients hold NaN or inf
  (parameters and optimizer state untouched, ``train/nonfinite_skipped`` > 0 in the
  step's metrics). After ``algorithm.max_nonfinite_steps`` such steps *in a row* (a
  finite step resets the count; 0 never stops) the run stops with :class:`RunStopped`.
- a training rank's actor dies (killed, out of memory, node lost): its peers would wait in
  a collective until the process-group timeout, so :func:`gather` raises
  :class:`TrainActorDied` as soon as Ray reports the death, naming the rank's node and
  whether Ray reports that node dead (:func:`describe_node`: its raylet was lost); the
  run's cleanup then kills the other ranks, engines and router, and ``rl-train`` exits
  with status 1.

- steps that train nothing: every sample aborted (the engine refused or failed the request,
  the reward failed under ``rollout.on_reward_error=skip``) or every group filtered out.
  Such a step records its cause (:func:`empty_cause`, ``buffer/empty_cause``) and says it in
  its progress line; after ``algorithm.max_empty_steps`` of them in a row (0 never stops),
  or at the end of a run that trained no sample at all, the run stops with
  :class:`RunStopped` naming the cause, instead of ending with status 0 having learnt
  nothing.

- a trainer that disagrees with its engines: with ``algorithm.max_logprob_gap`` set, a step
  whose mean log-prob gap (:data:`GAP_KEY`) exceeds it stops the run
  (:func:`check_logprob_gap`), a correctness gate for weight sync and kernels.

The loops call :func:`check_step`, :func:`check_trained` and :func:`check_logprob_gap`
after recording a step; the
actor group gathers its ranks' results with :func:`gather`; ``rl-train`` prints
:func:`stop_message`.
"""

import math
import sys
import time
from pathlib import Path

NONFINITE_KEY = "train/nonfinite_skipped"
TRAINED_KEY = "train/num_samples"  # samples the step trained on
BATCH_KEY = "rollout/num_samples"  # samples the step's rollout produced
GAP_KEY = "mismatch/logprob_abs_diff_mean"  # mean |trainer - engine| log-prob of a step
EMPTY_CAUSE_KEY = "buffer/empty_cause"  # why a step trained nothing (a string)
# samples of an empty step that failed (aborted: engine refusal, reward failure, ...); an
# empty step without any only had its groups filtered, which is no fault of the run
EMPTY_FAILED_KEY = "buffer/empty_failed_samples"
# after a rank fails, how long to wait for Ray to report a dead peer: a lost node's ranks
# can reach the driver as dead seconds after a live rank's collective or engine connection
# broke (CI, under load: more than 5 s once), and naming the node beats the symptom
DEATH_GRACE_S = 15.0
# an actor Ray cannot reach (its node's raylet gone): how long to wait for Ray to mark the
# node dead, which its missed health checks take (5 x 3 s by default, more on a busy head)
NODE_LOSS_WAIT_S = 60.0


class RunStopped(RuntimeError):
    """The run cannot go on (the message says why)."""


class TrainActorDied(RuntimeError):
    """A training rank's Ray actor died while running ``method``."""

    def __init__(self, rank: int, method: str, cause: BaseException, where: str = ""):
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause)
        super().__init__(
            f"training rank {rank} (its Ray actor{where}) died during {method}: {first_line}"
        )
        self.rank, self.method = rank, method


def gather(refs: list, *, method: str, where=None) -> list:
    """``ray.get(refs)`` (one ref per rank, in rank order), except that a dead rank raises
    :class:`TrainActorDied` at once, and another rank's error raises at once too (after
    :data:`DEATH_GRACE_S` to see whether a dead peer caused it). ``where(rank, error)``,
    when given, says where the rank ran (``", on node ..."``) in the message."""
    import ray
    from ray.exceptions import RayActorError

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except RayActorError as died:
            raise _died(refs.index(ready[0]), method, died, where) from died
        except Exception:
            _raise_if_a_peer_died(refs, pending, method, where)
            raise
    return ray.get(refs)


def _died(rank: int, method: str, cause: BaseException, where) -> TrainActorDied:
    return TrainActorDied(rank, method, cause, where(rank, cause) if where is not None else "")


def _raise_if_a_peer_died(refs: list, pending: list, method: str, where) -> None:
    import ray
    from ray.exceptions import RayActorError

    if not pending:
        return
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S)
    for ref in done:
        try:
            ray.get(ref)
        except RayActorError as died:
            raise _died(refs.index(ref), method, died, where) from died
        except Exception:  # another rank's own error: the caller re-raises the first one
            continue


def describe_node(node_id: str, error: BaseException | None = None) -> str:
    """``", on node <ip> (<id>)"``, with ``", which Ray reports dead"`` once Ray has marked
    the node so. When ``error`` says Ray could not reach the actor (its node may be lost:
    Ray notices a lost raylet by missed health checks) this waits up to
    :data:`NODE_LOSS_WAIT_S` for the mark while the node still looks alive."""
    from ray.exceptions import ActorUnavailableError

    wait_s = NODE_LOSS_WAIT_S if isinstance(error, ActorUnavailableError) else 0.0
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
        alive = node is not None and node["Alive"]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    address = node["NodeManagerAddress"] if node is not None else "(address unknown)"
    return f", on node {address} ({node_id[:12]})" + ("" if alive else ", which Ray reports dead")


def merge_minibatch_metrics(metrics: dict, new: dict) -> dict:
    """A step's metrics over its minibatches: the later minibatch's values win, except
    :data:`GAP_KEY` (the first minibatch's, the only one on the engines' weights),
    :data:`NONFINITE_KEY`, which counts the skipped minibatches, and the loss and gradient
    norm of the last skipped one, kept as ``train/nonfinite_loss`` and
    ``train/nonfinite_grad_norm`` (NaN or inf: null in metrics.jsonl, shown in the warning)."""
    merged = metrics | new
    if GAP_KEY in metrics:  # measured before any update: later ones add the policy's drift
        merged[GAP_KEY] = metrics[GAP_KEY]
    if new.get(NONFINITE_KEY):
        merged["train/nonfinite_loss"] = new.get("loss/total", math.nan)
        merged["train/nonfinite_grad_norm"] = new.get("train/grad_norm", math.nan)
    if NONFINITE_KEY in metrics or NONFINITE_KEY in new:
        merged[NONFINITE_KEY] = metrics.get(NONFINITE_KEY, 0.0) + new.get(NONFINITE_KEY, 0.0)
    return merged


def check_step(run, step: int, metrics: dict) -> None:
    """Count non-finite steps in a row; print a warning for each; raise
    :class:`RunStopped` when ``algorithm.max_nonfinite_steps`` of them follow each other."""
    limit = run.config.algorithm.max_nonfinite_steps
    if not metrics.get(NONFINITE_KEY):
        run.extras["nonfinite_in_a_row"] = 0
        return
    in_a_row = run.extras.get("nonfinite_in_a_row", 0) + 1
    run.extras["nonfinite_in_a_row"] = in_a_row
    skipped, total = int(metrics[NONFINITE_KEY]), run.config.algorithm.num_minibatches
    loss, norm = (metrics.get(f"train/nonfinite_{k}") for k in ("loss", "grad_norm"))
    print(
        f"rl-train: step {step}: {skipped} of {total} minibatch updates skipped for a "
        f"non-finite loss ({loss}) or gradient norm ({norm}); {in_a_row} such step(s) in "
        f"a row, the run stops at {limit or 'never'}",
        file=sys.stderr,
        flush=True,
    )
    if limit and in_a_row >= limit:
        raise RunStopped(
            f"{in_a_row} non-finite steps in a row up to step {step} (NaN or inf in the loss "
            f"or gradients; algorithm.max_nonfinite_steps={limit})"
        )


def empty_cause(groups: list[list], config) -> str:
    """Why none of ``groups`` (a step's groups of samples) was trained, from the samples
    themselves: the engine's own error (``metadata["error"]``), the reward's failures
    (``metadata["reward_error"]``), other aborts, or groups the filter dropped."""
    from rl_core.types import SampleStatus

    samples = [s for group in groups for s in group]
    if not samples:
        return "the rollout returned no samples"
    engine = [s.metadata["error"] for s in samples if s.metadata.get("error")]
    reward = [s.metadata["reward_error"] for s in samples if s.metadata.get("reward_error")]
    aborted = sum(s.status is SampleStatus.ABORTED for s in samples)
    parts = []
    if engine:
        parts.append(f"{len(engine)} refused or failed by the engine (first: {_first(engine)})")
    if reward:
        parts.append(
            f"{len(reward)} whose reward failed, skipped under "
            f"rollout.on_reward_error=skip (first: {_first(reward)})"
        )
    if aborted > len(engine) + len(reward):
        parts.append(f"{aborted - len(engine) - len(reward)} aborted")
    whole = [g for g in groups if reached_the_filter(g)]
    if whole:
        parts.append(
            f"{len(whole)} group(s) dropped by "
            f"algorithm.group_filter={config.algorithm.group_filter}"
        )
    return f"of {len(samples)} samples, " + "; ".join(parts)


def reached_the_filter(group: list) -> bool:
    """No sample aborted by the engine, and enough scored (at least two, or the one of a
    group of one) for the buffer to judge the group (:mod:`rl_launcher.data.buffer`)."""
    from rl_core.types import SampleStatus
    from rl_launcher.data.buffer import reward_failed

    scored = [s for s in group if not reward_failed(s)]
    engine = any(s.status is SampleStatus.ABORTED for s in scored)
    return not engine and len(scored) >= min(2, len(group))


def _first(messages: list[str]) -> str:
    text = " ".join(messages[0].split())
    return text if len(text) <= 300 else text[:297] + "..."


def check_trained(run, step: int, metrics: dict) -> None:
    """Count steps in a row that trained no sample because samples failed; raise
    :class:`RunStopped` after ``algorithm.max_empty_steps`` of them (0: never), and at the
    last step of a run that trained no sample at all. A step whose samples all scored but
    whose groups were all filtered (``algorithm.group_filter``: a weak model on a hard task
    often scores a whole group alike) is reported but neither counts nor breaks the streak.
    Steps without :data:`TRAINED_KEY` (SFT) are not counted."""
    if TRAINED_KEY not in metrics:
        return
    extras, config = run.extras, run.config
    extras["trained_samples"] = extras.get("trained_samples", 0) + int(metrics[TRAINED_KEY])
    extras["steps_run"] = extras.get("steps_run", 0) + 1
    if metrics[TRAINED_KEY]:
        extras["empty_in_a_row"] = 0
        return
    failed = metrics.get(EMPTY_FAILED_KEY, 1.0) > 0  # else every group was only filtered
    in_a_row = extras["empty_in_a_row"] = extras.get("empty_in_a_row", 0) + int(failed)
    cause, limit = metrics.get(EMPTY_CAUSE_KEY, "cause unknown"), config.algorithm.max_empty_steps
    if not config.logging.progress:  # else the progress line says it
        print(f"rl-train: step {step} trained no sample: {cause}", file=sys.stderr, flush=True)
    if limit and failed and in_a_row >= limit:
        raise RunStopped(
            f"{in_a_row} steps in a row up to step {step} trained no sample "
            f"(algorithm.max_empty_steps={limit}); step {step}: {cause}"
        )
    if step == config.num_steps and not extras["trained_samples"]:
        raise RunStopped(
            f"the run trained no sample in its {extras['steps_run']} step(s); step {step}: {cause}"
        )


def last_checkpoint(config) -> str:
    """Where a ``--resume`` would continue from, in words."""
    from rl_launcher.infra import checkpoints

    done = checkpoints.complete_checkpoints(checkpoints.checkpoint_dir(config))
    if not done:
        return "no complete checkpoint yet (--resume would start again at step 1)"
    step, path = done[-1]
    return f"last complete checkpoint: {path} (step {step}); continue with --resume"


def last_recorded_step(run_dir: str | Path) -> int:
    from rl_launcher.infra.run_log import read_metrics

    return max((int(r["step"]) for r in read_metrics(run_dir)), default=0)


def stop_message(config, error: BaseException) -> str:
    """What ``rl-train`` prints when :class:`RunStopped` or :class:`TrainActorDied` ends a run."""
    if isinstance(error, TrainActorDied):
        recorded = last_recorded_step(config.logging.run_dir)
        return f"{error} (after step {recorded} was recorded); {last_checkpoint(config)}"
    return f"{error}; {last_checkpoint(config)}"


def check_logprob_gap(config, step: int, metrics: dict) -> None:
    """Raise :class:`RunStopped` when the step's mean trainer-vs-engine log-prob gap
    exceeds ``algorithm.max_logprob_gap``."""
    bound, gap = config.algorithm.max_logprob_gap, metrics.get(GAP_KEY)
    if bound is None or gap is None or gap <= bound:
        return
    raise RunStopped(
        f"step {step}: the trainer's and the engines' log-probs of the same tokens differ by "
        f"{gap:.4g} on average ({GAP_KEY}), above algorithm.max_logprob_gap={bound}: weight "
        "sync, sampling temperature or kernels disagree. Check them, or raise (or unset) "
        "algorithm.max_logprob_gap"
    )
