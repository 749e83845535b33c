"""The running batch's per-row state as arrays, so a decode round's bookkeeping is a few
array operations for the whole batch instead of a Python loop of checks per row.

A rollout batch of 1,024 rows where rows finish at almost every step changes membership at
almost every step: the table follows it by indexing its arrays (:meth:`RowTable.take`,
:meth:`RowTable.cat`) instead of being rebuilt from the requests. The rows' new tokens and
log-probs stay in an :class:`~rl_sglang.engine.rows.OutputBuffer` until a request needs
them as lists (:meth:`RowTable.flush`): when it finishes, is aborted or retracted, or is
checked one by one (stop strings, a per-token callback).
"""

import dataclasses

import numpy as np
import torch

from rl_sglang.engine.request import Request
from rl_sglang.engine.rows import OutputBuffer, on_device
from rl_sglang.engine.sampling import RowParams
from rl_sglang.engine.stopping import StopChecker
from rl_sglang.protocol import finish_reason

_NO_TOKEN = -1  # pads a row's stop ids; never a sampled token


@dataclasses.dataclass
class RowTable:
    """One entry per running row, in row order.

    ``lengths``: tokens in each row's response so far; ``limits``: the length at which it
    stops (:class:`~rl_sglang.engine.stopping.StopRule`); ``stop_ids`` ``[B, S]``: its stop
    token ids, padded with -1; ``watched``: rows checked one by one each step (stop strings,
    or a per-token callback); ``greedy``/``truncating``/``seeded``: what :attr:`params`
    summarises, known on the host; ``params``: the rows' sampling tensors on the device;
    ``outputs``: the tokens not yet in the requests' lists, row ``i``'s in slot
    ``slots[i]``, its response's first ``flushed[i]`` tokens being in its lists.
    :meth:`take` and :meth:`cat` hand the buffer on: the table they were called on is not
    used after them."""

    params: RowParams
    lengths: np.ndarray
    limits: np.ndarray
    stop_ids: np.ndarray
    watched: np.ndarray
    greedy: np.ndarray
    truncating: np.ndarray
    seeded: np.ndarray
    outputs: OutputBuffer
    slots: np.ndarray
    flushed: np.ndarray

    @classmethod
    def of(cls, requests: list[Request], stopper: StopChecker, params: RowParams) -> "RowTable":
        """The table of ``requests`` (whose sampling tensors are ``params``)."""
        rules = [stopper.rule(r) for r in requests]
        width = max((len(rule.token_ids) for rule in rules), default=0)
        stop_ids = np.full((len(requests), width), _NO_TOKEN, dtype=np.int64)
        for row, rule in enumerate(rules):
            stop_ids[row, : len(rule.token_ids)] = sorted(rule.token_ids)
        lengths = np.array([len(r.output_ids) for r in requests], dtype=np.int64)
        outputs = OutputBuffer(len(requests))
        return cls(
            params=params,
            lengths=lengths,
            limits=np.array([rule.length for rule in rules], dtype=np.int64),
            stop_ids=stop_ids,
            watched=np.array(
                [
                    rule.strings or r.on_token is not None
                    for r, rule in zip(requests, rules, strict=True)
                ],
                dtype=bool,
            ),
            greedy=np.array([r.params.temperature == 0 for r in requests], dtype=bool),
            truncating=np.array([_truncates(r.params) for r in requests], dtype=bool),
            seeded=np.array([r.params.sampling_seed is not None for r in requests], dtype=bool),
            outputs=outputs,
            slots=np.arange(len(requests)),
            flushed=lengths.copy(),
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def rooms(self, pending: int) -> np.ndarray:
        """How many more tokens each row may get, ``pending`` tokens not yet counted."""
        return self.limits - self.lengths - pending

    def positions(self, pending: int) -> torch.Tensor | None:
        """Index in its response of the token each row draws next (``pending``: tokens of a
        queued round not yet counted), for seeded draws; None when no row is seeded."""
        seed = self.params.seed
        return None if seed is None else on_device(self.lengths + pending, torch.long, seed.device)

    def stops(self, tokens_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """After ``tokens_B`` were counted: which rows drew one of their stop ids, and which
        reached their length limit."""
        matched = (tokens_B[:, None] == self.stop_ids).any(axis=1)
        return matched, self.lengths >= self.limits

    def append(self, tokens_B: np.ndarray, logprobs_B: np.ndarray, live: np.ndarray) -> None:
        """One decode step: each ``live`` row's token and log-prob, counted."""
        if live.all():  # no row stopped within the round: one assignment for the batch
            self.outputs.write(self.slots, self.lengths - self.flushed, tokens_B, logprobs_B)
            self.lengths += 1
            return
        rows = np.flatnonzero(live)
        columns = self.lengths[rows] - self.flushed[rows]
        self.outputs.write(self.slots[rows], columns, tokens_B[rows], logprobs_B[rows])
        self.lengths[rows] += 1

    def flush(self, requests: list[Request], rows) -> None:
        """Move the buffered tokens and log-probs of ``rows`` (indices into ``requests``,
        the running rows in order) to their requests' lists."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = self.lengths[rows] - self.flushed[rows]
        width = int(counts.max(initial=0))
        if not width:
            return
        slots = self.slots[rows]  # every row's buffer in one conversion, cut to its count
        tokens = self.outputs.tokens[slots, :width].tolist()
        logprobs = self.outputs.logprobs[slots, :width].tolist()
        for row, count, row_tokens, row_logprobs in zip(
            rows.tolist(), counts.tolist(), tokens, logprobs, strict=True
        ):
            request = requests[row]
            request.output_ids += row_tokens[:count] if count < width else row_tokens
            request.output_logprobs += row_logprobs[:count] if count < width else row_logprobs
        self.flushed[rows] = self.lengths[rows]

    def take(self, rows: list[int], index: torch.Tensor) -> "RowTable":
        """The table of ``rows`` only, in that order (``index``: ``rows`` on the device);
        the rows left out must have been flushed (their slots are free again)."""
        picked = np.asarray(rows, dtype=np.int64)
        unflushed = self.lengths - self.flushed
        assert unflushed.sum() == unflushed[picked].sum(), "a row left with unflushed tokens"
        greedy, truncating, seeded = (
            self.greedy[picked],
            self.truncating[picked],
            self.seeded[picked],
        )
        return RowTable(
            params=_select_params(self.params, index, greedy, truncating, seeded),
            lengths=self.lengths[picked],
            limits=self.limits[picked],
            stop_ids=self.stop_ids[picked],
            watched=self.watched[picked],
            greedy=greedy,
            truncating=truncating,
            seeded=seeded,
            outputs=self.outputs,
            slots=self.slots[picked],
            flushed=self.flushed[picked],
        )

    def cat(self, other: "RowTable") -> "RowTable":
        """This table's rows, then ``other``'s (whose tokens must all be flushed: they move
        to this table's buffer)."""
        if not len(self):
            return other
        assert (other.lengths == other.flushed).all(), "rows joined with unflushed tokens"
        width = max(self.stop_ids.shape[1], other.stop_ids.shape[1])
        greedy = np.concatenate([self.greedy, other.greedy])
        truncating = np.concatenate([self.truncating, other.truncating])
        seeded = np.concatenate([self.seeded, other.seeded])
        return RowTable(
            params=_cat_params(self.params, other.params, greedy, truncating, seeded),
            lengths=np.concatenate([self.lengths, other.lengths]),
            limits=np.concatenate([self.limits, other.limits]),
            stop_ids=np.concatenate([_pad(self.stop_ids, width), _pad(other.stop_ids, width)]),
            watched=np.concatenate([self.watched, other.watched]),
            greedy=greedy,
            truncating=truncating,
            seeded=seeded,
            outputs=self.outputs,
            slots=np.concatenate([self.slots, self.outputs.allocate(self.slots, len(other))]),
            flushed=np.concatenate([self.flushed, other.flushed]),
        )


def append_round(
    table: RowTable,
    requests: list[Request],
    tokens_KB: np.ndarray,
    logprobs_KB: np.ndarray,
    stopper: StopChecker,
) -> dict[int, dict]:
    """Append a round's tokens ``[K, B]`` and log-probs to the running rows (``requests``,
    in order), step by step, each row up to its stop; the finish reason of each row that
    stopped, whose request then holds its whole response. Rows without stop strings or a
    per-token callback are appended and checked as arrays, their lists filled when they
    finish; the others are flushed every step and checked through ``stopper`` as before."""
    finished: dict[int, dict] = {}
    live = np.ones(len(requests), dtype=bool)
    any_watched = bool(table.watched.any())
    for tokens_B, logprobs_B in zip(tokens_KB, logprobs_KB, strict=True):
        table.append(tokens_B, logprobs_B, live)
        matched, at_limit = table.stops(tokens_B)
        stopped = matched | at_limit
        if any_watched:
            stopped &= live & ~table.watched
        elif finished:
            stopped &= live
        for row in np.flatnonzero(stopped).tolist():
            finished[row] = (
                finish_reason("stop", matched=int(tokens_B[row]))
                if matched[row]
                else finish_reason("length", length=int(table.lengths[row]))
            )
        watched = np.flatnonzero(table.watched & live).tolist() if any_watched else []
        if watched:
            table.flush(requests, watched)
        for row in watched:
            request = requests[row]
            if request.on_token is not None:
                request.on_token(request)
            reason = stopper.check(request)
            if reason is not None:
                finished[row] = reason
        if finished:
            live[list(finished)] = False
            if not live.any():
                break
    if finished:
        table.flush(requests, list(finished))
    return finished


def _truncates(params) -> bool:
    return params.top_k > 0 or params.top_p < 1 or params.min_p > 0


def _pad(stop_ids: np.ndarray, width: int) -> np.ndarray:
    return np.pad(stop_ids, ((0, 0), (0, width - stop_ids.shape[1])), constant_values=_NO_TOKEN)


def _select_params(params: RowParams, index, greedy, truncating, seeded) -> RowParams:
    return RowParams(
        temperature=params.temperature[index],
        top_k=params.top_k[index],
        top_p=params.top_p[index],
        min_p=params.min_p[index],
        seed=params.seed[index] if seeded.any() else None,
        all_greedy=bool(greedy.all()),
        truncates=bool(truncating.any()),
    )


def _cat_params(first: RowParams, second: RowParams, greedy, truncating, seeded) -> RowParams:
    def cat(name):
        return torch.cat([getattr(first, name), getattr(second, name)])

    seeds = [_seeds_or_unseeded(p) for p in (first, second)]
    return RowParams(
        temperature=cat("temperature"),
        top_k=cat("top_k"),
        top_p=cat("top_p"),
        min_p=cat("min_p"),
        seed=torch.cat(seeds) if seeded.any() else None,
        all_greedy=bool(greedy.all()),
        truncates=bool(truncating.any()),
    )


def _seeds_or_unseeded(params: RowParams) -> torch.Tensor:
    if params.seed is not None:
        return params.seed
    temperature = params.temperature
    return torch.full(temperature.shape, -1, dtype=torch.long, device=temperature.device)
