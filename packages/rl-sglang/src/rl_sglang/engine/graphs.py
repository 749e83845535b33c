"""CUDA graphs of the static runner's decode step, one per batch bucket.

A bucket's graph reads its tokens from a static buffer and its positions straight from the
runner's ``lengths`` (rows past the live batch use their free slot's stale length), and
leaves the logits and the greedy token and log-prob of every row in static outputs, so a
greedy step costs one small copy in, the replay and one increment.

With ``multi_step`` K > 1 a bucket also gets a graph of K greedy steps in a row: each
step feeds its argmax to the next and advances ``lengths`` inside the graph, and the K
tokens and log-probs land in ``[K, B]`` outputs, so K steps cost one replay and one copy
back (the scheduler trims what follows a row's stop). These are captured when a bucket
first decodes greedily, not up front: capturing one costs about K single-step captures
(0.55 s for a 30-layer model on an H100, 3.9 s for all buckets).

With the runner's ``sampled_multi_step`` a bucket also gets K-step graphs that draw each
token inside the round (:func:`~rl_sglang.engine.sampling.sample_next` over the rows'
parameters, copied into static buffers before each replay): one with top-k/top-p/min-p
truncation and one without, each captured at its first use.
"""

import torch

from rl_sglang.engine.sampling import RowParams


class GraphCache:
    """One CUDA graph per batch bucket (powers of two up to ``max_slots``)."""

    def __init__(self, runner, multi_step: int = 1):
        self.runner, self.multi_step = runner, multi_step
        self.buckets = sorted(
            {min(1 << i, runner.max_slots) for i in range(runner.max_slots.bit_length() + 1)}
        )
        self.graphs: dict[int, tuple] = {}
        self.multi: dict[int, tuple] = {}  # bucket -> the K-step graph
        self.sampled: dict[tuple[int, bool], tuple] = {}  # (bucket, truncates) -> K-step graph
        self.pool = None

    @torch.inference_mode()
    def capture_all(self) -> None:
        """The single-step graph of every bucket (before any request is admitted)."""
        for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its pool
            self.graphs[bucket] = self._capture(bucket)
        self.runner.lengths.zero_()

    @torch.inference_mode()
    def _capture_multi(self, bucket: int) -> tuple:
        """The K-step graph of ``bucket``, captured while rows may be running: its warm-up
        writes keys/values only at positions past each row's length (masked, and rewritten
        when decoding reaches them) and the lengths it advances are put back. Its own
        memory pool: the single-step graphs' outputs stay valid."""
        saved = self.runner.lengths.clone()
        captured = self._capture(bucket, self.multi_step, pool=None)
        self.runner.lengths.copy_(saved)
        return captured

    def run(self, tokens_B: torch.Tensor, size: int, steps: int = 1) -> tuple[torch.Tensor, ...]:
        """Replay the smallest bucket holding ``size`` rows; views of its outputs
        (valid until the next replay): logits ``[B, V]``, greedy tokens and log-probs, or
        with ``steps`` = K > 1 the K-step graph's greedy tokens and log-probs ``[K, B]``."""
        bucket = next(b for b in self.buckets if b >= size)
        if steps > 1 and bucket not in self.multi:
            self.multi[bucket] = self._capture_multi(bucket)
        graph, tokens_in, outputs = (self.graphs if steps == 1 else self.multi)[bucket]
        tokens_in[:size].copy_(tokens_B)
        graph.replay()
        return tuple(out[:size] if steps == 1 else out[:, :size] for out in outputs)

    def run_sampled(self, tokens_B, size: int, rows: RowParams, positions_B):
        """Replay the sampled K-step graph of the smallest bucket holding ``size`` rows
        (captured at its first use) with ``rows``' parameters and first draw positions;
        views of its tokens and log-probs ``[K, B]``."""
        bucket = next(b for b in self.buckets if b >= size)
        key = (bucket, rows.truncates)
        if key not in self.sampled:
            self.sampled[key] = self._capture_sampled(bucket, rows.truncates)
        graph, tokens_in, static, positions_in, outputs = self.sampled[key]
        tokens_in[:size].copy_(tokens_B)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            getattr(static, name)[:size].copy_(getattr(rows, name))
        if rows.seed is None:
            static.seed[:size].fill_(-1)
        else:
            static.seed[:size].copy_(rows.seed)
            positions_in[:size].copy_(positions_B)
        graph.replay()
        return tuple(out[:, :size] for out in outputs)

    @torch.inference_mode()
    def _capture_sampled(self, bucket: int, truncates: bool) -> tuple:
        """A sampled K-step graph (see :meth:`_capture_multi` for the warm-up's writes),
        reading every row's parameters from static buffers; rows past the live batch draw
        at temperature 1 with no seed (their tokens are dropped)."""
        device, saved = self.runner.device, self.runner.lengths.clone()

        def full(value, dtype):
            return torch.full((bucket,), value, dtype=dtype, device=device)

        static = RowParams(
            temperature=full(1.0, torch.float32),
            top_k=full(-1, torch.long),
            top_p=full(1.0, torch.float32),
            min_p=full(0.0, torch.float32),
            seed=full(-1, torch.long),
            truncates=truncates,
        )
        positions_in = full(0, torch.long)
        tokens_in = full(0, torch.long)
        steps = self.multi_step

        def sampled():
            positions = positions_in.clone()  # advanced inside, read fresh each replay
            return self.runner.sampled_steps(tokens_in, bucket, steps, static, positions)

        graph, outputs = self._record(sampled, pool=None)
        self.runner.lengths.copy_(saved)
        return graph, tokens_in, static, positions_in, outputs

    def _record(self, fn, pool):
        """Warm ``fn`` up twice on a side stream, then capture it; the graph and outputs."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # allocations, autotuning
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = fn()
        return graph, outputs

    def _capture(self, bucket: int, steps: int = 1, pool="shared"):
        runner = self.runner
        pool = self.pool if pool == "shared" else pool
        tokens_in = torch.zeros(bucket, dtype=torch.long, device=runner.device)
        positions = runner.lengths[:bucket]
        if steps == 1:
            graph, outputs = self._record(lambda: runner.step(tokens_in, positions), pool)
            self.pool = graph.pool()
        else:
            graph, outputs = self._record(
                lambda: runner.greedy_steps(tokens_in, bucket, steps), pool
            )
        return graph, tokens_in, outputs
