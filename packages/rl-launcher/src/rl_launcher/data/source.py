"""The prompt source: datasets mixed by weight, shuffled per epoch, resumable exactly.

Each dataset walks its own epochs; epoch ``e`` of dataset ``d`` visits every kept prompt
once in an order fixed by ``(seed, d, e)``. Which dataset the ``k``-th prompt comes from is
fixed by ``(seed, k)`` and the weights. So the whole stream is a function of the seed and
the position, and :meth:`PromptSource.state_dict` (draw count, and epoch and offset per
dataset) is enough to continue exactly where a run stopped, epoch boundaries included.

Files are streamed while loading; the kept prompts (text and token ids) stay in memory.
"""

import dataclasses
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_core.types import Sample
from rl_launcher.config import DataConfig, DatasetConfig
from rl_launcher.data.prompts import MalformedRow, sample_from_row
from rl_launcher.data.reader import iter_rows, parse_spec

logger = logging.getLogger(__name__)
_MAX_REPORTED = 10


@dataclass
class DatasetStats:
    rows: int = 0
    kept: int = 0
    malformed: int = 0
    too_long: int = 0
    malformed_examples: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """The numbers a run's first record shows (``data/<dataset>/<name>``)."""
        return {
            "rows": self.rows,
            "kept": self.kept,
            "malformed": self.malformed,
            "too_long": self.too_long,
        }


@dataclass
class PromptDataset:
    """The kept prompts of one dataset, in file order, with what was dropped and why."""

    name: str
    prompts: list[Sample]
    stats: DatasetStats


def load_dataset(
    spec: DatasetConfig,
    *,
    tokenizer: Any = None,
    apply_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    on_malformed: str = "skip",
    batch_rows: int = 1024,
) -> PromptDataset:
    """Read, check, format and length-filter one dataset (see :mod:`rl_launcher.data.prompts`)."""
    name = spec.name or parse_spec(spec.path)[0].stem
    stats, prompts = DatasetStats(), []
    for row in iter_rows(spec.path, batch_rows=batch_rows):
        stats.rows += 1
        try:
            if row.error is not None:
                raise MalformedRow(row.error)
            sample = sample_from_row(
                row.value, spec, tokenizer=tokenizer, apply_chat_template=apply_chat_template
            )
        except MalformedRow as error:
            _report_malformed(stats, f"{row.where}: {error}", on_malformed)
            continue
        if max_prompt_tokens is not None and len(sample.tokens) > max_prompt_tokens:
            stats.too_long += 1
            continue
        sample.metadata.update(dataset=name, row=row.index)
        prompts.append(sample)
    stats.kept = len(prompts)
    if stats.malformed or stats.too_long:
        logger.warning(
            "dataset %s: kept %d of %d rows (%d malformed, %d longer than %s tokens)",
            name,
            stats.kept,
            stats.rows,
            stats.malformed,
            stats.too_long,
            max_prompt_tokens,
        )
    return PromptDataset(name=name, prompts=prompts, stats=stats)


def _report_malformed(stats: DatasetStats, message: str, on_malformed: str) -> None:
    if on_malformed == "raise":
        raise ValueError(f"malformed row {message} (set data.on_malformed=skip to skip such rows)")
    stats.malformed += 1
    if len(stats.malformed_examples) < _MAX_REPORTED:
        stats.malformed_examples.append(message)
        logger.warning("skipping malformed row %s", message)


class PromptSource:
    """An endless, deterministic stream of prompt Samples drawn from weighted datasets.

    Every prompt comes out as a fresh Sample whose ``group_index`` is its draw number and
    whose metadata holds ``dataset``, ``row`` and ``epoch``.
    """

    def __init__(
        self,
        datasets: Sequence[PromptDataset],
        weights: Sequence[float],
        *,
        seed: int,
        shuffle: bool = True,
    ):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("PromptSource needs one weight per dataset and at least one dataset")
        for dataset, weight in zip(datasets, weights, strict=True):
            if weight > 0 and not dataset.prompts:
                raise ValueError(_empty_message(dataset))
        total = float(sum(weights))
        self.datasets, self.seed, self.shuffle = list(datasets), seed, shuffle
        self._cumulative = [sum(weights[: i + 1]) / total for i in range(len(weights))]
        self._num_drawn = 0
        self._epochs = [0] * len(datasets)
        self._offsets = [0] * len(datasets)
        self._orders: dict[int, tuple[int, list[int]]] = {}

    def next_batch(self, num_prompts: int) -> list[Sample]:
        return [self.next_prompt() for _ in range(num_prompts)]

    def next_prompt(self) -> Sample:
        d = self._pick_dataset(self._num_drawn)
        dataset = self.datasets[d]
        if self._offsets[d] == len(dataset.prompts):
            self._epochs[d], self._offsets[d] = self._epochs[d] + 1, 0
        row = self._order(d)[self._offsets[d]]
        self._offsets[d] += 1
        template = dataset.prompts[row]
        sample = dataclasses.replace(
            template,
            tokens=list(template.tokens),
            group_index=self._num_drawn,
            metadata={**template.metadata, "epoch": self._epochs[d]},
        )
        self._num_drawn += 1
        return sample

    def _pick_dataset(self, draw: int) -> int:
        if len(self.datasets) == 1:
            return 0
        u = random.Random(f"{self.seed}/mix/{draw}").random()
        return next((i for i, c in enumerate(self._cumulative) if u < c), len(self._cumulative) - 1)

    def _order(self, d: int) -> list[int]:
        epoch = self._epochs[d]
        cached = self._orders.get(d)
        if cached is None or cached[0] != epoch:
            order = list(range(len(self.datasets[d].prompts)))
            if self.shuffle:
                random.Random(f"{self.seed}/{d}/{epoch}").shuffle(order)
            self._orders[d] = cached = (epoch, order)
        return cached[1]

    @property
    def stats(self) -> dict[str, DatasetStats]:
        return {dataset.name: dataset.stats for dataset in self.datasets}

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream (JSON-serialisable)."""
        return {
            "seed": self.seed,
            "num_drawn": self._num_drawn,
            "datasets": [
                {"name": ds.name, "size": len(ds.prompts), "epoch": e, "offset": o}
                for ds, e, o in zip(self.datasets, self._epochs, self._offsets, strict=True)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state taken over different data or seed."""
        mine = [(ds.name, len(ds.prompts)) for ds in self.datasets]
        theirs = [(d["name"], d["size"]) for d in state["datasets"]]
        if mine != theirs or state["seed"] != self.seed:
            raise ValueError(
                f"data state was saved for datasets {theirs} with seed {state['seed']}, but this "
                f"run has {mine} with seed {self.seed}; resume with the same data and seed"
            )
        self._num_drawn = int(state["num_drawn"])
        self._epochs = [int(d["epoch"]) for d in state["datasets"]]
        self._offsets = [int(d["offset"]) for d in state["datasets"]]
        self._orders.clear()


def _empty_message(dataset: PromptDataset) -> str:
    s = dataset.stats
    return (
        f"dataset {dataset.name!r} has no usable prompts ({s.rows} rows: {s.malformed} malformed, "
        f"{s.too_long} too long); check its prompt_key or raise data.max_prompt_tokens"
    )


class CustomSource:
    """``data.source``: the user's class behind the built-in source's interface. It yields
    prompts (``next_prompt() -> Sample``) and saves / restores its position
    (``state_dict()`` JSON, ``load_state_dict(state)``); this wrapper numbers the draws
    (``group_index``), which the run's groups, checkpoints and seeds key on."""

    def __init__(self, inner: Any, path: str):
        self.inner, self.path, self._num_drawn = inner, path, 0

    def next_prompt(self) -> Sample:
        sample = self.inner.next_prompt()
        if not isinstance(sample, Sample):
            raise ValueError(
                f"data.source {self.path!r}: next_prompt() returned {type(sample).__name__}, "
                "not an rl_core.Sample"
            )
        sample.group_index, self._num_drawn = self._num_drawn, self._num_drawn + 1
        return sample

    def next_batch(self, num_prompts: int) -> list[Sample]:
        return [self.next_prompt() for _ in range(num_prompts)]

    @property
    def stats(self) -> dict[str, DatasetStats]:
        return dict(getattr(self.inner, "stats", {}) or {})

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.path, "num_drawn": self._num_drawn, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") != self.path:
            raise ValueError(
                f"data state was saved by source {state.get('source')!r}, this run reads "
                f"data.source={self.path!r}; resume with the same source"
            )
        self._num_drawn = int(state["num_drawn"])
        self.inner.load_state_dict(state["inner"])


def build_prompt_source(data: DataConfig, *, seed: int, tokenizer: Any = None) -> PromptSource:
    """The training prompt source of a run's ``data`` config (``data.source``'s class when
    set: :class:`CustomSource`)."""
    if data.source is not None:
        from rl_core.registry import load_dotted

        inner = load_dotted(data.source)(data, seed=seed, tokenizer=tokenizer)
        return CustomSource(inner, data.source)
    datasets = [
        load_dataset(
            spec,
            tokenizer=tokenizer,
            apply_chat_template=data.apply_chat_template,
            max_prompt_tokens=data.max_prompt_tokens,
            on_malformed=data.on_malformed,
            batch_rows=data.read_batch_rows,
        )
        for spec in data.train
    ]
    return PromptSource(
        datasets, [spec.weight for spec in data.train], seed=seed, shuffle=data.shuffle
    )
