"""PPO's critic (``algorithm.advantage_estimator=gae``): a value-head model per rank.

Each step, once the buffer has complete groups:

    values  = critic(step batch)                    # [B, T] on response tokens (old values)
    A, R    = rl_core gae(rewards on last token [- reward_kl_coef * KL per token], values,
                          gamma, lam); A whitened
    actor   trains on A;  critic trains on R with rl_core's clipped value loss

The critic group is one Ray actor per training rank (rl-fsdp's :class:`FSDPCritic`, or
rl-megatron's ``MegatronBackend`` with ``critic=True`` and the actor's layout when
``backend.name: megatron``; its own gloo / nccl group, meeting at its rank 0's node:
:mod:`rl_launcher.infra.rendezvous`), placed on the training ranks' bundles; a step's
batches are per data-parallel rank, as the trainer's; it is checkpointed beside the
trainer (``critic/``). Alignment follows TrainBatch: the value at position t is the value
of the state that predicts token t + 1, so response token j of a sample with prompt
length P has its value at position P - 1 + j.
"""

import dataclasses
from pathlib import Path

import ray
import torch

from rl_core.advantages import AdvantageInputs
from rl_core.batch import TrainBatch, batch_from_samples
from rl_core.types import scalar_reward
from rl_launcher.data.buffer import (
    DataBuffer,
    StepBatch,
    packed,
    response_mask,
    response_rows,
    split_by_rank,
)
from rl_launcher.infra.rendezvous import GroupMember, meet, spans_nodes


class CriticWorker(GroupMember):
    """One critic rank (a Ray actor)."""

    def __init__(self, rank: int, world_size: int, config, backend: str = "fsdp"):
        self.rank, self.world_size, self.config = rank, world_size, config
        self.backend = backend  # "fsdp" (FSDPCritic) or "megatron" (config.critic is True)

    def join(self, host: str, port: int) -> None:
        """Join the critic group at its rank 0's ``host:port``, then build the critic."""
        from rl_launcher.roles.backends import backend_class

        self.join_group("cuda" if self.config.device == "cuda" else "cpu", host, port)
        critic_class = backend_class("megatron") if self.backend == "megatron" else _fsdp_critic()
        self.critic = critic_class.start(
            self.config,
            rank=self.rank,
            world_size=self.world_size,
            master_addr=host,
            master_port=port,
        )

    def data_rank(self) -> int:
        return self.critic.data_rank

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.critic.compute_values(batch).cpu()

    def train_steps(self, batches: list[TrainBatch]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for batch in batches:
            metrics |= self.critic.train_step(batch)
        return metrics

    def save(self, path: str) -> None:
        self.critic.save_checkpoint(Path(path))

    def load(self, path: str) -> None:
        self.critic.load_checkpoint(Path(path))


def _fsdp_critic():
    from rl_fsdp import FSDPCritic

    return FSDPCritic


def critic_config(actor_config, optimizer, *, value_clip: float | None = None):
    """The actor's rl-fsdp or rl-megatron config turned into the critic's: no reference,
    own lr (Megatron: a value head, ``value_clip`` the algorithm's)."""
    lr = optimizer.critic_lr if optimizer.critic_lr is not None else optimizer.lr
    objective = dataclasses.replace(
        actor_config.objective, kl_coef=0.0, reward_kl_coef=0.0, entropy_coef=0.0, mode="policy"
    )
    if hasattr(actor_config, "critic"):  # rl_megatron.config.MegatronConfig
        return dataclasses.replace(
            actor_config,
            critic=True,
            lr=lr,
            ref_path=None,
            objective=objective,
            value_clip=value_clip,
            train_only=(),
            freeze=(),
        )
    return dataclasses.replace(
        actor_config,
        lr=lr,
        reference=False,
        ref_offload=False,
        objective=objective,
        train_only=(),  # model.train_only / freeze name the policy's parameters
        freeze=(),
    )


class CriticGroup:
    """``len(slots)`` :class:`CriticWorker` actors on the training ranks' bundles."""

    def __init__(self, config, placement, slots, *, num_gpus: float = 0, backend: str = "fsdp"):
        actor = ray.remote(CriticWorker)
        # num_cpus=0: the bundle's CPUs are the trainer's; the two take turns within a step
        self.workers = [
            actor.options(
                num_cpus=0, num_gpus=num_gpus, scheduling_strategy=placement.strategy(slot)
            ).remote(rank, len(slots), config, backend)
            for rank, slot in enumerate(slots)
        ]
        self.address = meet(self.workers, spans_nodes=spans_nodes(placement, slots))
        # Megatron: TP / CP peers share a data-parallel rank's batch, as the trainer's do
        self.data_ranks = ray.get([w.data_rank.remote() for w in self.workers])

    def call(self, method: str, *per_data_rank_args, **shared) -> list:
        """``method`` on every rank (rank r gets ``args[data_rank(r)]``); rank order."""
        refs = [
            getattr(worker, method).remote(
                *(args[self.data_ranks[r]] for args in per_data_rank_args), **shared
            )
            for r, worker in enumerate(self.workers)
        ]
        return ray.get(refs)

    def values(self, batches: list[TrainBatch]) -> list[torch.Tensor]:
        """Values of each data-parallel rank's batch (its first rank's answer)."""
        values = self.call("values", batches)
        return [values[self.data_ranks.index(d)] for d in range(len(batches))]

    def train_steps(self, parts: list[list[TrainBatch]]) -> dict[str, float]:
        """Critic optimizer steps; metrics named ``critic/...`` (``loss/value`` kept)."""
        num_data_ranks = len(parts[0]) if parts else 0
        per_rank = [[part[d] for part in parts] for d in range(num_data_ranks)]
        metrics = self.call("train_steps", per_rank)[0]
        return {
            k if k.startswith("critic/") or k == "loss/value" else f"critic/{k}": v
            for k, v in metrics.items()
        }

    def save(self, path: str) -> None:
        self.call("save", path=str(Path(path).absolute()))  # absolute: as the ranks see it

    def load(self, path: str) -> None:
        self.call("load", path=str(Path(path).absolute()))

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)


def start_critic(run, model_dir) -> None:
    """Start ``run.critic`` on the training ranks' bundles when the algorithm needs one
    (stopped with the run); needs the trainer started (``run.plan``, ``run.placement``)."""
    from rl_launcher.roles.backends import fsdp_config, megatron_config

    config = run.config
    if config.algorithm.advantage_estimator != "gae":
        return
    slots = list(run.plan.train_bundles)
    # on GPU the critic shares each training rank's device (it takes a quarter of it)
    num_gpus = 0.25 if config.cluster.device == "cuda" else 0
    backend = config.backend.name
    build_actor = megatron_config if backend == "megatron" else fsdp_config
    critic = critic_config(
        build_actor(config, model_dir=model_dir),
        config.optimizer,
        value_clip=config.algorithm.value_clip,
    )
    run.critic = CriticGroup(critic, run.placement, slots, num_gpus=num_gpus, backend=backend)
    run._cleanup.append(run.critic.shutdown)


def response_values(samples, critic, num_ranks: int) -> torch.Tensor:
    """Critic values ``[B, T]`` of each sample's response tokens (0 past its end)."""
    parts, batches = split_by_rank(batch_from_samples(samples), samples, num_ranks)
    per_rank = critic.values(batches)
    return response_rows(samples, parts, per_rank)


class GaeBuffer(DataBuffer):
    """The data buffer with critic values: GAE advantages, and returns / old values in
    every rank batch for the critic's loss."""

    def __init__(self, *, value_fn, **kwargs):
        super().__init__(**kwargs)
        self.value_fn = value_fn  # samples -> [B, T] response values
        self._targets: tuple[list, list] = ([], [])

    def advantages(
        self, samples: list, kl: torch.Tensor | None = None, group_sizes: list[int] | None = None
    ) -> list[list[float]]:
        rewards = torch.tensor([scalar_reward(s, self.reward_key) for s in samples])
        mask = response_mask(samples)
        values = self.value_fn(samples)
        inputs = AdvantageInputs(
            rewards=rewards,
            mask=mask,
            values=values * mask,
            group_size=self.group_size,
            gamma=self.gamma,
            lam=self.lam,
            kl=kl,
            kl_coef=self.reward_kl_coef,
            group_sizes=self.ragged(group_sizes),
            whiten=self.whiten,
        )
        advantages, returns = self._estimator(inputs)
        rows = [s.response_length for s in samples]
        self._targets = (
            [r[:n] for r, n in zip(returns.tolist(), rows, strict=True)],
            [v[:n] for v, n in zip(values.tolist(), rows, strict=True)],
        )
        return [a[:n] for a, n in zip(advantages.tolist(), rows, strict=True)]

    def _with_targets(self, step: StepBatch, rank_batches: list[TrainBatch]) -> list[TrainBatch]:
        """The critic's targets of the last :meth:`advantages` call in every rank batch."""
        returns, old_values = self._targets
        rank_batches = [
            dataclasses.replace(
                b,
                returns=packed(step.samples, returns, part),
                old_values=packed(step.samples, old_values, part),
            )
            for b, part in zip(rank_batches, step.partitions, strict=True)
        ]
        num_tokens = max(1, sum(len(r) for r in returns))
        step.metrics["critic/returns_mean"] = sum(sum(r) for r in returns) / num_tokens
        return rank_batches


def make_buffer(run) -> DataBuffer:
    """The run's data buffer: with critic values when the run has a critic."""
    critic = run.critic
    if critic is None:
        return DataBuffer.from_config(run.config, num_ranks=run.num_ranks)
    return GaeBuffer.from_config(
        run.config,
        num_ranks=run.num_ranks,
        value_fn=lambda samples: response_values(samples, critic, run.num_ranks),
    )


def train_critic(run, parts) -> dict[str, float]:
    """One critic update on the step's minibatches (nothing without a critic)."""
    return {} if run.critic is None else run.critic.train_steps(parts)
