"""The distillation teacher (``distill.*``): an engine that scores the student's samples.

    teacher = start_teacher(run)          # distill.teacher_url, or an embedded engine
    score_groups(run, groups)             # after the rollout, before the buffer

Each completed sample's ``tokens`` (prompt + response) go to the teacher's ``/generate``
with ``max_new_tokens: 0`` and prompt log-probs, batched (:meth:`rl_sglang.client.
EngineClient.prompt_logprobs_batch`); the log-probs of the response tokens land in
``metadata[TEACHER_KEY]``, where the buffer's advantages read them
(:func:`rl_launcher.data.buffer.distilled`). A sample that already carries them (a
replayed dump) is not scored again. The teacher is never updated: it keeps its weights.
"""

import asyncio
from pathlib import Path

from rl_core.types import SampleStatus
from rl_launcher.data.buffer import TEACHER_KEY

TEACHER_START_TIMEOUT_S = 300.0
SCORE_BATCH = 32  # sequences per request to the teacher (scored in shared forwards)
MAX_CONCURRENT_REQUESTS = 8  # requests in flight to the teacher at once


def start_teacher(run) -> str | None:
    """The teacher's URL (None without distillation); with ``distill.teacher_path`` an
    embedded engine is started on it first and stopped with the run."""
    distill = run.config.distill
    if distill.coef == 0:
        return None
    url = distill.teacher_url or _start_embedded(run, distill.teacher_path)
    run.extras["teacher"] = url
    return url


def _start_embedded(run, model_path: str) -> str:
    from rl_sglang.process import EmbeddedEngine

    log_dir = Path(run.config.logging.run_dir) / "teacher_logs"
    engine = EmbeddedEngine(model_path, dtype=run.config.model.dtype, log_dir=log_dir)
    engine.start(wait=False)
    run._cleanup.append(engine.stop)
    engine.wait_ready(timeout_s=TEACHER_START_TIMEOUT_S)
    return engine.url


def score_groups(run, groups: list[list]) -> bool:
    """Give every completed sample of ``groups`` its teacher log-probs (in place); False
    when the run has no teacher."""
    url = run.extras.get("teacher")
    if url is None:
        return False
    samples = [
        s
        for group in groups
        for s in group
        if TEACHER_KEY not in s.metadata and s.status != SampleStatus.ABORTED
    ]
    scores = asyncio.run(teacher_log_probs(url, [s.tokens for s in samples]))
    for sample, logprobs in zip(samples, scores, strict=True):
        sample.metadata[TEACHER_KEY] = logprobs[len(logprobs) - sample.response_length :]
    return True


async def teacher_log_probs(url: str, sequences: list[list[int]]) -> list[list[float]]:
    """Teacher-forced log-probs of each sequence after its first token (``[len - 1]``),
    asked in requests of ``SCORE_BATCH`` sequences, a few at a time."""
    from rl_sglang.client import EngineClient

    limit = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS)
    chunks = [sequences[i : i + SCORE_BATCH] for i in range(0, len(sequences), SCORE_BATCH)]

    async def one(client, chunk):
        async with limit:
            return await client.prompt_logprobs_batch(chunk)

    async with EngineClient(url, retries=2) as client:
        scored = await asyncio.gather(*(one(client, chunk) for chunk in chunks))
    return [logprobs for chunk in scored for logprobs in chunk]
