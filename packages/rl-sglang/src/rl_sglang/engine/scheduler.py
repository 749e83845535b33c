"""Continuous batching: one thread that admits, decodes and retires requests.

Between two decode steps the scheduler thread runs queued control tasks (weight updates,
cache flushes, memory release), applies aborts, and prefills waiting requests into the
running batch, so a request arriving mid-generation joins at the next step instead of
waiting for the batch to drain. Everything that touches the model runs on this thread.
"""

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from rl_sglang.engine.request import Request
from rl_sglang.engine.routes import RouteRecorder
from rl_sglang.engine.row_table import RowTable, append_round
from rl_sglang.engine.rows import Launched, fill_holes, on_device
from rl_sglang.engine.runner import ModelRunner
from rl_sglang.engine.sampling import RowParams, sample_next
from rl_sglang.engine.stats import BatchTimes
from rl_sglang.engine.stopping import StopChecker
from rl_sglang.protocol import PAUSE_MODES, finish_reason

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the running batch. Thread-safe entry points: :meth:`submit`, :meth:`abort`,
    :meth:`pause`, :meth:`resume`, :meth:`call`, :meth:`stop`."""

    def __init__(self, runner: "ModelRunner", stopper: StopChecker, *, max_batch_size: int = 64):
        self.runner, self.stopper = runner, stopper
        self.max_batch_size = max_batch_size
        self.lora = None  # engine.lora.LoRAManager with --enable-lora: told each forward's rows
        self.routes = RouteRecorder()  # the routers' choices, with --enable-return-routed-experts
        self.weight_version = "0"
        self.paused = False
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()
        self._aborts: list[tuple[str | None, Future]] = []  # rid None = abort all
        self._running: list[Request] = []
        self._state = None  # the runner's handle of the running batch
        self._next_tokens: torch.Tensor | None = None
        self._stopped = False
        self.num_finished = 0
        self._table: RowTable | None = None  # the running rows' state as arrays
        self._admitting: list[Request] = []  # popped from the queue, not yet running
        self.times = BatchTimes()  # logged and reset when the running batch drains
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # ---- thread-safe entry points -------------------------------------------------------
    def submit(self, *requests: Request) -> None:
        """Queue ``requests`` at once, so the next admission prefills them together (the n
        samples of one prompt, or a batch, share one prefill and one decode batch)."""
        with self._cond:
            self._waiting.extend(requests)
            self._cond.notify()

    def abort(self, rid: str | None = None) -> Future:
        """Abort one request by id, or every waiting and running one (``rid=None``); the
        Future resolves once it is applied, so an abort answered is never left queued to
        hit requests submitted after it."""
        future: Future = Future()
        with self._cond:
            self._aborts.append((rid, future))
            self._cond.notify()
        return future

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler thread between two steps; its result in a Future."""
        future: Future = Future()
        with self._cond:
            self._tasks.append((fn, future))
            self._cond.notify()
        return future

    def pause(self, mode: str = "abort") -> Future:
        """SGLang's pause modes: ``abort`` in-flight requests, ``retract`` them to the queue
        (they are prefilled again on continue), or keep them ``in_place``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; choose one of {PAUSE_MODES}")
        return self.call(lambda: self.pause_now(mode))

    def resume(self) -> Future:
        return self.call(self.resume_now)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- scheduler thread ---------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._stopped:
                    break
                tasks, self._tasks = list(self._tasks), deque()
                aborts, self._aborts = self._aborts, []
            for fn, future in tasks:
                self._run_task(fn, future)
            for rid, future in aborts:
                self._run_task(lambda rid=rid: self.abort_now(rid), future)
            if not self.paused:
                self._admit_and_step()
        self.abort_now(None, message="engine shut down")
        with self._cond:
            aborts, self._aborts = self._aborts, []
        for _, future in aborts:
            future.set_result(None)  # nothing is left to abort

    def _admit_and_step(self) -> None:
        try:
            self._admit()
            self._step()
            self._log_if_drained()
        except Exception as error:  # a failed step must not hang every waiting client
            logger.exception("decode step failed; aborting the running batch")
            self._flush_running()  # the partial outputs go back with the abort
            failed, self._running = self._running + self._admitting, []
            self._drop_batch()
            for request in failed:
                if request.finish is None:
                    self._finish(request, finish_reason("abort", message=f"engine error: {error}"))

    def _log_if_drained(self) -> None:
        if self.times.started is not None and not self._running:
            logger.info(self.times.summary())
            self.times = BatchTimes()

    def _has_work(self) -> bool:
        runnable = not self.paused and (self._waiting or self._running)
        return bool(self._stopped or self._tasks or self._aborts or runnable)

    @staticmethod
    def _run_task(fn: Callable[[], Any], future: Future) -> None:
        try:
            future.set_result(fn())
        except Exception as error:  # handed to the caller through the future
            future.set_exception(error)

    # ---- on the scheduler thread only (inside call()) -----------------------------------
    def pause_now(self, mode: str) -> int:
        self.paused = True
        num_in_flight = len(self._running)
        if mode == "abort":
            self.abort_now(None, message="generation paused")
        elif mode == "retract":
            self._flush_running()  # prefilled again with the tokens they have
            with self._cond:
                self._waiting.extendleft(reversed(self._running))
            self._drop_batch()
        return num_in_flight

    def resume_now(self) -> None:
        if self.runner is None:
            raise ValueError("memory is released; call /resume_memory_occupation first")
        self.paused = False

    def _flush_running(self) -> None:
        """Move every running row's buffered tokens to its request's lists (skipped where a
        failed step left the table and the running rows out of step: tokens are lost
        rather than given to the wrong request)."""
        if self._table is not None and len(self._table) == len(self._running):
            self._table.flush(self._running, range(len(self._running)))

    def _drop_batch(self) -> None:
        if self.runner is not None:
            self.runner.select(self._state, [])
        self._running, self._state, self._next_tokens, self._table = [], None, None, None

    def abort_now(self, rid: str | None, message: str = "aborted by request") -> None:
        with self._cond:
            hit = [r for r in self._waiting if r.matches(rid)]
            for request in hit:
                self._waiting.remove(request)
        for request in hit:
            self._finish(request, finish_reason("abort", message=message))
        keep = [i for i, r in enumerate(self._running) if not r.matches(rid)]
        gone = sorted(set(range(len(self._running))) - set(keep))
        if gone and self._table is not None:
            self._table.flush(self._running, gone)  # an abort returns the partial output
        for row in gone:
            self._finish(self._running[row], finish_reason("abort", message=message))
        self._keep_rows(keep)

    def _finish(self, request: Request, reason: dict) -> None:
        request.weight_version = self.weight_version
        request.text = self.stopper.final_text(request, reason)
        self.num_finished += 1
        request.finish_with(reason)

    def _keep_rows(self, rows: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Keep only ``rows`` of the running batch (the others flushed); their previous
        indices in the new order, and those on the device (None when nothing changed), so
        a round in flight selects the same rows without uploading them again."""
        if len(rows) == len(self._running):
            return rows, None
        if not rows:
            self._drop_batch()
            return rows, None
        rows = fill_holes(rows)  # the static runner then moves only the rows past the end
        self._running = [self._running[i] for i in rows]
        self._state = None if self._state is None else self.runner.select(self._state, rows)
        index = on_device(rows, torch.long, self._table.params.temperature.device)
        self._table = self._table.take(rows, index)
        if self._next_tokens is not None:
            self._next_tokens = self._next_tokens[index.to(self._next_tokens.device)]
        return rows, index

    def _admit(self) -> None:
        with self._cond:
            free = self.max_batch_size - len(self._running)
            new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        new = self._admitting = [r for r in new if not self._finished_before_start(r)]
        if not new:
            return
        self.times.admitted(len(new))
        with self.times.timed("prefill"):
            self.use_adapters(new)
            prompts = [r.prompt_ids + r.output_ids for r in new]
            self.routes.arm(new)
            logits_BV, state = self.runner.prefill(prompts)
            self.routes.after_prefill(new, prompts)
            params = RowParams.stack([r.params for r in new], logits_BV.device)
            table = RowTable.of(new, self.stopper, params)
            tokens_B = self._sample(logits_BV, new, table)
            self._state = self.runner.merge(self._state, state)
            self._admitting = []
            self._running.extend(new)
            self._table = table if self._table is None else self._table.cat(table)
            previous = self._next_tokens
            self._next_tokens = tokens_B if previous is None else torch.cat([previous, tokens_B])
        self._retire(len(self._running) - len(new))

    def _finished_before_start(self, request: Request) -> bool:
        if len(request.output_ids) >= request.params.max_new_tokens:
            self._finish(request, finish_reason("length", length=len(request.output_ids)))
            return True
        return False

    def _step(self) -> None:
        """Decode rounds for the running batch (a round is one step, or K greedy steps in
        one go when the runner has ``multi_step`` K and no row can reach its length limit
        within them; K sampled steps too with the runner's ``sampled_multi_step``). While nothing else waits (no task, abort or admissible request),
        round ``r + 1`` is queued on the device before the host reads round ``r``'s tokens,
        so the host's bookkeeping overlaps the GPU's work. Rows that stop in round ``r``
        leave the batch while ``r + 1`` is in flight (their tokens of ``r + 1`` are
        dropped), so rows finishing at every step do not stall the pipeline."""
        if not self._running:
            return
        launched = self._launch(self._next_tokens, pending=0)
        self._next_tokens = None  # the rounds in flight hold the next tokens
        while True:
            ahead = None
            if self._can_look_ahead(launched.steps):
                ahead = self._launch(launched.tokens_B, pending=launched.steps)
            finished = self._consume(launched)
            if ahead is None:
                self._next_tokens = launched.tokens_B
                self._retire_rows(finished)
                return
            if finished:
                kept, index = self._retire_rows(finished)
                if not kept:
                    return
                ahead = ahead.select(kept, index)
            launched = ahead

    def _launch(self, tokens_B: torch.Tensor, pending: int) -> Launched:
        """Queue one decode round and the copy of its tokens and log-probs to the host;
        ``pending``: tokens of a queued round not yet appended to the requests."""
        self.times.rounds += 1
        with self.times.timed("launch"):
            rows = self._table.params
            self.use_adapters(self._running)
            self.routes.arm(self._running)
            if rows.all_greedy:  # argmax and log-prob come out of the (captured) step itself
                steps = self._round_steps(pending)
                out = self.runner.decode(self._state, tokens_B, greedy=True, steps=steps)
                self.routes.after_decode(self._running)
                return Launched(*out) if steps > 1 else Launched(out[0][None], out[1][None])
            positions_B = self._table.positions(pending)
            if getattr(self.runner, "sampled_multi_step", False):  # draws inside the round
                steps = self._round_steps(pending)
                if steps > 1:
                    out = self.runner.decode_sampled(
                        self._state, tokens_B, rows, positions_B, steps
                    )
                    self.routes.after_decode(self._running)
                    return Launched(*out)
            logits_BV = self.runner.decode(self._state, tokens_B)
            self.routes.after_decode(self._running)
            tokens_B, logprobs_B = sample_next(logits_BV, rows, positions_B)
            return Launched(tokens_B[None], logprobs_B[None])

    def _round_steps(self, pending: int) -> int:
        """The runner's ``multi_step`` K when K steps cannot pass any row's length limit
        nor keep anything waiting, else 1."""
        steps = getattr(self.runner, "multi_step", 1)
        if steps > 1 and self._quiet() and self._table.rooms(pending).min() >= steps:
            return steps
        return 1

    def _consume(self, launched: Launched) -> dict[int, dict]:
        """Append a launched round's tokens to the running rows, step by step, up to each
        row's stop; the finish reason of each row that stopped."""
        with self.times.timed("wait"):
            tokens_KB, logprobs_KB = launched.wait()
        with self.times.timed("bookkeeping"):
            return append_round(self._table, self._running, tokens_KB, logprobs_KB, self.stopper)

    def _quiet(self) -> bool:
        """Nothing the loop would do between rounds: no task, abort, pause or admissible
        request."""
        if self._tasks or self._aborts or self._stopped or self.paused:
            return False
        return not (self._waiting and len(self._running) < self.max_batch_size)

    def _can_look_ahead(self, pending: int) -> bool:
        """True when queueing another round now cannot run past a limit or delay anything
        the loop would do between rounds (``pending`` tokens are not appended yet)."""
        return self._quiet() and bool((self._table.rooms(pending) > 0).all())

    def _retire_rows(self, finished: dict[int, dict]) -> tuple[list[int], torch.Tensor | None]:
        """Finish the ``finished`` rows (flushed) and compact the batch; the kept rows'
        previous indices in their new order, and on the device (see :meth:`_keep_rows`)."""
        if not finished:
            return list(range(len(self._running))), None
        with self.times.timed("bookkeeping"):
            for row, reason in finished.items():
                self._finish(self._running[row], reason)
            kept = np.ones(len(self._running), dtype=bool)
            kept[list(finished)] = False
            return self._keep_rows(np.flatnonzero(kept).tolist())

    def _sample(self, logits_BV: torch.Tensor, requests: list[Request], table: RowTable):
        """Sample one token per request (their rows: ``table``) and append it (with its
        log-prob) to the request, counted in ``table``; the tokens on the device."""
        tokens_B, logprobs_B = sample_next(logits_BV, table.params, table.positions(0))
        tokens, logprobs = (
            row[0].tolist() for row in Launched(tokens_B[None], logprobs_B[None]).wait()
        )
        for request, token, logprob in zip(requests, tokens, logprobs, strict=True):
            request.output_ids.append(token)
            request.output_logprobs.append(logprob)
            if request.on_token is not None:
                request.on_token(request)
        table.lengths += 1
        table.flushed += 1
        return tokens_B

    def use_adapters(self, requests: list[Request]) -> None:
        """The LoRA adapter of each row of the next forwards (``requests`` in row order)."""
        if self.lora is not None:
            self.lora.use([r.adapter for r in requests])

    def _retire(self, first_row: int) -> None:
        """Finish running requests (from ``first_row`` on) whose last token stopped them."""
        reasons = {
            row: self.stopper.check(self._running[row])
            for row in range(first_row, len(self._running))
        }
        self._retire_rows({row: reason for row, reason in reasons.items() if reason is not None})
