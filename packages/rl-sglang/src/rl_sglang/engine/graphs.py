"""CUDA graphs of the static runner's decode step, one per batch bucket.

A bucket's graph reads its tokens from a static buffer and its positions straight from the
runner's ``lengths`` (rows past the live batch use their free slot's stale length), and
leaves the logits and the greedy token and log-prob of every row in static outputs, so a
greedy step costs one small copy in, the replay and one increment.
"""

import torch


class GraphCache:
    """One CUDA graph per batch bucket (powers of two up to ``max_slots``)."""

    def __init__(self, runner):
        self.runner = runner
        self.buckets = sorted(
            {min(1 << i, runner.max_slots) for i in range(runner.max_slots.bit_length() + 1)}
        )
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    @torch.inference_mode()
    def capture_all(self) -> None:
        for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its pool
            self.graphs[bucket] = self._capture(bucket)
        self.runner.lengths.zero_()

    def run(self, tokens_B: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        """Replay the smallest bucket holding ``size`` rows; views of its outputs
        (valid until the next replay): logits ``[B, V]``, greedy tokens and log-probs."""
        bucket = next(b for b in self.buckets if b >= size)
        graph, tokens_in, outputs = self.graphs[bucket]
        tokens_in[:size].copy_(tokens_B)
        graph.replay()
        return tuple(out[:size] for out in outputs)

    def _capture(self, bucket: int):
        runner = self.runner
        tokens_in = torch.zeros(bucket, dtype=torch.long, device=runner.device)
        positions = runner.lengths[:bucket]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocations, autotuning)
                runner.step(tokens_in, positions)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = runner.step(tokens_in, positions)
        self.pool = graph.pool()
        return graph, tokens_in, outputs
