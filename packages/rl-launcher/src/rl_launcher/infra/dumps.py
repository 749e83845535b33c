"""Debugging aids: rollout dumps, train-only replay of them, and rollout-only runs.

- ``rollout.dump_dir``: the scored samples each step trains on go to ``rollout_<step>.jsonl``
  (one :class:`~rl_core.types.Sample` JSON per line, grouped by ``group_index``; written
  to a temporary name and renamed, so a file is complete or absent; no pickle).
- ``rollout.replay_dir``: train only, on those files in order, instead of generating:
  no engines start, and the trainer sees exactly the dumped tokens, rewards and rollout
  log-probs (a way to reproduce a training step without the engines).
- ``rollout.rollout_only``: engines generate and score (and dump), nothing trains.
"""

import os
import random
import re
from pathlib import Path

from rl_core.types import Sample
from rl_launcher.infra.paths import inside
from rl_launcher.roles.engine_pool import NoEngines

_DUMP_FILE = re.compile(r"^rollout_(\d+)\.jsonl$")


def dump_path(directory: str | Path, index: int) -> Path:
    return Path(directory) / f"rollout_{index:06d}.jsonl"


def write_rollout(path: Path, groups: list[list[Sample]]) -> Path:
    """``groups`` as JSONL at ``path``, atomically (temporary file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for group in groups:
            for sample in group:
                handle.write(sample.to_json() + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def read_rollout(path: Path) -> list[list[Sample]]:
    """The groups of a dump, in file order; a bad line is reported as ``file:line``."""
    groups: dict[int, list[Sample]] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                sample = Sample.from_json(line)
                sample.validate()
            except ValueError as error:  # json.JSONDecodeError is a ValueError too
                raise ValueError(f"{path}:{number}: not a dumped sample ({error})") from None
            groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())


def dump_files(directory: str | Path) -> list[Path]:
    """Complete dump files of ``directory``, in rollout order."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    files = inside(directory, directory.iterdir(), what="rollout dump")
    found = [(int(m.group(1)), p) for p in files if (m := _DUMP_FILE.match(p.name))]
    return [path for _, path in sorted(found)]


class ReplayRollout:
    """Stands in for both the rollout manager and the prompt source of a train-only run:
    each ``rollout()`` returns the groups of the next dump file. As a
    :class:`~rl_launcher.roles.rollout_role.RolloutRole` it has no engines (nothing to
    sync), no reward and no prompts in flight."""

    reward_fn = None

    def __init__(
        self, replay_dir: str | Path, *, group_size: int, fraction: float = 1.0, seed: int = 0
    ):
        self.fraction, self.seed = fraction, seed  # rollout.replay_fraction, the run's seed
        self.engines = NoEngines()
        self.files, self.group_size, self.position = dump_files(replay_dir), group_size, 0
        if not self.files:
            raise ValueError(
                f"rollout.replay_dir={str(replay_dir)!r} holds no rollout_*.jsonl dumps; "
                "dump some first with rollout.dump_dir"
            )

    def rollout(self, num_groups: int, step: int | None = None):
        """The next dump's groups, whatever ``step`` (a replay goes through its dumps)."""
        if self.position >= len(self.files):
            raise ValueError(
                f"rollout.replay_dir has {len(self.files)} rollouts and the run wants more; "
                f"set num_steps <= {len(self.files)}"
            )
        path = self.files[self.position]
        groups = read_rollout(path)
        for group in groups:
            if len(group) != self.group_size:
                raise ValueError(
                    f"{path}: group {group[0].group_index} has {len(group)} samples, but "
                    f"rollout.group_size={self.group_size}; replay with the dump's group size"
                )
        self.position += 1
        groups = subsample(groups, self.fraction, seed=self.seed + self.position)
        return groups, {"replay/rollout_index": float(self.position)}

    @property
    def stats(self) -> dict:
        """As a source: no dataset was loaded, nothing kept or dropped."""
        return {}

    def consumed(self, groups: list[list[Sample]]) -> None:
        """Nothing was drawn: the position moved when the file was read."""

    def data_state(self) -> dict:
        return {"source": self.state_dict(), "pending": []}

    def load_data_state(self, state: dict) -> None:
        self.load_state_dict(state["source"])

    def stop(self) -> None:
        """Nothing runs."""

    def state_dict(self) -> dict:
        return {"replay_position": self.position, "replay_files": len(self.files)}

    def load_state_dict(self, state: dict) -> None:
        if "replay_position" not in state:
            raise ValueError("this checkpoint was not written by a replay run; resume it as such")
        self.position = int(state["replay_position"])


def subsample(groups: list, fraction: float, *, seed: int) -> list:
    """``fraction`` of ``groups`` (at least one; all of them at 1), drawn with ``seed``
    and kept in their order (slime's ``--load-debug-rollout-data-subsample``)."""
    if fraction >= 1.0 or not groups:
        return groups
    keep = max(1, round(fraction * len(groups)))
    picked = sorted(random.Random(seed).sample(range(len(groups)), keep))
    return [groups[i] for i in picked]
