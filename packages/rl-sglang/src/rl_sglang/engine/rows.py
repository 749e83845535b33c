"""Per-step helpers of the scheduler: the host copy of a queued step, the running rows'
new tokens kept as arrays until a request needs them as lists, the order that keeps slot
moves small when rows leave the batch, and host lists sent to the device without waiting
for it."""

import copy

import numpy as np
import torch


def fill_holes(rows: list[int]) -> list[int]:
    """``rows`` reordered so every kept row below ``len(rows)`` keeps its index and the
    rows past the end fill the holes: ``[0, 1, 3, 4] -> [0, 1, 4, 3]`` (one row moves)."""
    size = len(rows)
    movers = iter(row for row in rows if row >= size)
    kept = {row for row in rows if row < size}
    return [row if row in kept else next(movers) for row in range(size)]


def on_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list or array) as a tensor on ``device``, queued behind the device's
    work rather than waiting for it: a copy from pageable host memory to a GPU first
    synchronises the stream, which would stall the round in flight, so the values go
    through pinned memory (PyTorch's caching host allocator keeps the buffer until the copy
    is done)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Launched:
    """A queued round of K decode steps (K = 1 but for multi-step greedy rounds): the last
    step's device tokens ``[B]`` and a pending host copy of the tokens and log-probs
    ``[K, B]`` (one wait on the device per round, not one per tensor, step or row)."""

    def __init__(self, tokens_KB: torch.Tensor, logprobs_KB: torch.Tensor):
        self.steps = tokens_KB.shape[0]
        self.tokens_B = tokens_KB[-1]
        self._host = (tokens_KB, logprobs_KB)
        self._event, self._rows = None, None
        if tokens_KB.is_cuda:  # pinned targets: the copy must not block the host
            self._host = tuple(_pinned_copy(t) for t in self._host)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens_KB.device))

    def wait(self) -> tuple[np.ndarray, np.ndarray]:
        """The round's tokens and log-probs ``[K, B]`` on the host (copies the caller owns)."""
        if self._event is not None:
            self._event.synchronize()
        tokens, logprobs = (t.numpy() for t in self._host)
        if self._rows is None:
            return tokens.copy(), logprobs.copy()
        return tokens[:, self._rows], logprobs[:, self._rows]  # fancy indexing copies

    def select(self, rows: list[int], index: torch.Tensor | None = None) -> "Launched":
        """This round's outputs for ``rows`` only, in that order: the running batch was
        compacted while the round was in flight (``index``: ``rows`` already on the device,
        so they are not uploaded twice)."""
        picked = copy.copy(self)
        if index is None:
            index = on_device(rows, torch.long, self.tokens_B.device)
        picked.tokens_B = self.tokens_B[index.to(self.tokens_B.device)]
        rows = np.asarray(rows, dtype=np.int64)
        picked._rows = rows if self._rows is None else self._rows[rows]
        return picked


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class OutputBuffer:
    """The running rows' newest tokens and log-probs, one buffer row (a slot) per running
    row, written for the whole batch in one array assignment per decode step; a row's
    values move into its request's Python lists only when something needs them
    (:meth:`rl_sglang.engine.row_table.RowTable.flush`). Column ``j`` of a slot holds the
    ``j``-th token since the row's last flush. Grows (doubling) in slots and columns. The
    slots in use are the running rows' (:attr:`RowTable.slots`), so rows leaving the batch
    free theirs without a call here."""

    def __init__(self, num_slots: int, num_columns: int = 64):
        self.tokens = np.zeros((num_slots, num_columns), dtype=np.int64)
        self.logprobs = np.zeros((num_slots, num_columns), dtype=np.float32)

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0]

    def allocate(self, in_use: np.ndarray, count: int) -> np.ndarray:
        """``count`` slots other than ``in_use`` (distinct slots)."""
        needed = len(in_use) + count
        if needed > self.num_slots:
            self._grow(num_slots=max(2 * self.num_slots, needed))
        free = np.ones(self.num_slots, dtype=bool)
        free[in_use] = False
        return np.flatnonzero(free)[:count]

    def write(self, slots, columns, tokens, logprobs) -> None:
        """Each row's token and log-prob at its ``(slot, column)``; the log-probs' dtype
        is kept (a float64 input widens the buffer instead of being rounded)."""
        needed = int(columns.max(initial=-1)) + 1
        if needed > self.tokens.shape[1]:
            self._grow(num_columns=max(2 * self.tokens.shape[1], needed))
        if logprobs.dtype != self.logprobs.dtype:
            wide = np.result_type(self.logprobs.dtype, logprobs.dtype)
            self.logprobs = self.logprobs.astype(wide, copy=False)
        self.tokens[slots, columns] = tokens
        self.logprobs[slots, columns] = logprobs

    def _grow(self, num_slots: int | None = None, num_columns: int | None = None) -> None:
        old_slots, old_columns = self.tokens.shape
        shape = (num_slots or old_slots, num_columns or old_columns)
        for name in ("tokens", "logprobs"):
            old = getattr(self, name)
            new = np.zeros(shape, dtype=old.dtype)
            new[:old_slots, :old_columns] = old
            setattr(self, name, new)
