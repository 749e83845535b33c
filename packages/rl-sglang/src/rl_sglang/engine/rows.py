"""Per-step helpers of the scheduler: the host copy of a queued step, and the order that
keeps slot moves small when rows leave the batch."""

import torch


def fill_holes(rows: list[int]) -> list[int]:
    """``rows`` reordered so every kept row below ``len(rows)`` keeps its index and the
    rows past the end fill the holes: ``[0, 1, 3, 4] -> [0, 1, 4, 3]`` (one row moves)."""
    size = len(rows)
    movers = iter(row for row in rows if row >= size)
    kept = {row for row in rows if row < size}
    return [row if row in kept else next(movers) for row in range(size)]


class Launched:
    """A queued step: its device tokens ``[B]`` and a pending host copy of the tokens and
    log-probs (one wait on the device per step, not one per tensor or row)."""

    def __init__(self, tokens_B: torch.Tensor, logprobs_B: torch.Tensor):
        self.tokens_B = tokens_B
        self._host = (tokens_B, logprobs_B)
        self._event = None
        if tokens_B.is_cuda:  # pinned targets: the copy must not block the host
            self._host = tuple(_pinned_copy(t) for t in self._host)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens_B.device))

    def wait(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        tokens, logprobs = self._host
        return tokens.tolist(), logprobs.tolist()


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
