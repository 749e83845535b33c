"""The PPO critic: the same architecture with a one-output value head per position,
trained with rl_core's clipped value loss and the step's global denominators.

Alignment: ``values[t]`` is the value of the state that predicts token t + 1 (the
"prediction at position" convention), so it lines up with ``returns`` / ``old_values`` /
``loss_mask`` of the TrainBatch without shifting.
"""

import torch

from rl_core.batch import TrainBatch
from rl_core.losses import value_loss
from rl_core.objective import aggregate_batch
from rl_fsdp.engine import ShardedTrainer
from rl_fsdp.forward import packed_values
from rl_fsdp.modeling import reshard_all


class FSDPCritic(ShardedTrainer):
    head = "value"
    takes_lora = False  # a new value head has nothing to adapt: the critic trains in full

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Values ``[N]`` float32 of this rank's batch, no graph built."""
        self.onload()
        batch = batch.to(self.device)
        budget = self.config.micro_batch_tokens_for_log_probs

        def values(mb: TrainBatch) -> torch.Tensor:
            return packed_values(self.model, mb, impl=self.attention, pad_to=budget)

        with torch.no_grad(), self.computing():
            out = self.per_token(batch, budget, values)
            reshard_all(self.model)
        return out

    def micro_batch_loss(self, mb: TrainBatch) -> tuple[torch.Tensor, dict]:
        if mb.returns is None:
            raise ValueError("the critic needs batch.returns (e.g. from rl_core.advantages.gae)")
        budget = self.config.max_tokens_per_micro_batch
        values = packed_values(self.model, mb, impl=self.attention, pad_to=budget)
        old_values = mb.old_values if mb.old_values is not None else values.detach()
        per_token, clipfrac = value_loss(
            values, old_values, mb.returns, clip=self.config.value_clip
        )

        def agg(x: torch.Tensor) -> torch.Tensor:
            return aggregate_batch(self.config.objective, x, mb)

        loss = agg(per_token)
        metrics = {
            "loss/value": loss.detach(),  # read back once per step
            "critic/clipfrac": agg(clipfrac),
            "critic/values_mean": agg(values.detach()),
        }
        return loss, metrics
