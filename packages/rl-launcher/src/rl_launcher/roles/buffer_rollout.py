"""``rollout.source: buffer``: a step trains on the scored trajectories agent workers write
into a rollout buffer (rl-sglang's :class:`~rl_sglang.agent.buffer.RolloutBuffer`) instead
of generating from prompts.

The engines and the router start as usual, and the workers generate through the router
(or an agent gateway in front of it); weight sync and checkpoints are unchanged, so the
engines the workers use carry the trained weights. The buffer listens on ``engine.host``
(a key, ``RL_SGLANG_API_KEY``, is needed off loopback); its URL and the router's go to
``<run_dir>/rollout_buffer_url.json`` for the workers. A step waits for ``batch_size``
groups, or after ``rollout.buffer_timeout_s`` takes what arrived if that is at least
``rollout.buffer_min_ratio`` of them; fewer stops the run (:class:`RunStopped`).

Restarts: the buffer keeps each served group in ``<run_dir>/rollout_buffer.json`` until a
checkpoint holds its training. A checkpoint records the last serve number trained on;
the next collection settles (forgets) those, and a resumed run puts every group served
after its checkpoint back at the front, so it trains on what an uninterrupted run would
have, and no accepted group is lost.
"""

import json
import os
import time
from pathlib import Path

from rl_launcher.infra.faults import RunStopped
from rl_launcher.roles.rollout_manager import RolloutManager

BUFFER_FILE, URL_FILE = "rollout_buffer.json", "rollout_buffer_url.json"


class BufferRollout(RolloutManager):
    """A rollout manager whose groups come from the rollout buffer (see the module doc)."""

    def __init__(self, config, *, run_dir: Path, **kwargs):
        from rl_sglang.agent.buffer import RolloutBuffer

        super().__init__(config, **kwargs)
        self.run_dir = Path(run_dir)
        self.buffer = RolloutBuffer(
            self.run_dir / BUFFER_FILE,
            until_settled=True,
            api_key=os.environ.get("RL_SGLANG_API_KEY"),
        )
        self.buffer_url = None
        self._trained = 0  # the highest serve number the loop is done with
        self._saved = 0  # the serve number the last checkpoint recorded
        self._requeued_once = False
        self._num_groups = 0  # groups numbered across steps (the loop groups by number)

    def start(self) -> "BufferRollout":
        super().start()
        host, port = self.config.engine.host, self.config.rollout.buffer_port
        self.buffer_url = self.engines.call(self.buffer.start(host=host, port=port))
        engines = self.engines.url
        urls = {"buffer": self.buffer_url, "engines": engines}
        (self.run_dir / URL_FILE).write_text(json.dumps(urls) + "\n")
        print(
            f"rl-train: rollout buffer at {self.buffer_url}/buffer/write (engines at "
            f"{engines}; both in {self.run_dir / URL_FILE})",
            flush=True,
        )
        return self

    async def _rollout(self, num_groups: int, step: int):
        """The next ``num_groups`` groups the workers wrote (whatever ``step``: the buffer
        holds what the workers made)."""
        if not self._requeued_once:  # served before a restart, never checkpointed
            requeued = self.buffer.requeue_after(self._saved)
            self._requeued_once = True
        else:  # the last checkpoint is complete by now (the loop saves, then asks)
            requeued = 0
            self.buffer.settle(self._saved)
        rollout, started = self.config.rollout, time.monotonic()
        try:
            groups = await self.buffer.collect(
                num_groups, min_ratio=rollout.buffer_min_ratio, timeout_s=rollout.buffer_timeout_s
            )
        except TimeoutError as error:
            counts = self.buffer.counts
            raise RunStopped(
                f"{error} (accepted {counts['accepted']}, rejected {counts['rejected']} so far)"
            ) from None
        for group in groups:
            self._number(group)
        counts = self.buffer.counts
        metrics = {
            "wait_s": time.monotonic() - started,
            "groups": len(groups),
            "pending": len(self.buffer.pending),
            "requeued": requeued,
            **{name: counts[name] for name in ("accepted", "rejected", "duplicates")},
        }
        return groups, {f"rollout_buffer/{k}": float(v) for k, v in metrics.items()}

    def _number(self, group) -> None:
        """Give the group a run-wide number (the buffer numbers from 0 in each take)."""
        for i, sample in enumerate(group):
            sample.group_index = self._num_groups
            sample.index = self._num_groups * 1_000_000 + i
            sample.metadata["draw"] = self._num_groups
        self._num_groups += 1

    def consumed(self, groups) -> None:
        served = [s.metadata["buffer_serve"] for g in groups for s in g]
        self._trained = max([self._trained, *served])

    def data_state(self) -> dict:
        """What a checkpoint records: the last serve number trained on (the buffer forgets
        those groups at the next collection, once the checkpoint is complete)."""
        self._saved = self._trained
        return {"source": {"buffer_served": self._trained}, "pending": []}

    def load_data_state(self, state: dict) -> None:
        if "buffer_served" not in state["source"]:
            raise ValueError(
                "this checkpoint was not written with rollout.source=buffer; resume it with "
                "rollout.source=prompts"
            )
        self._saved = self._trained = int(state["source"]["buffer_served"])

    def stop(self) -> None:
        if self.buffer_url is not None:
            self.engines.call(self.buffer.stop())
        super().stop()
