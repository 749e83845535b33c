"""A rollout function that writes down what its context says (``ctx.step``, the loop) to
``<run_dir>/rollout_steps.jsonl`` and then rolls out with examples/extend's pool
(test_remote_reward_run.py reads it across a ``--resume``)."""

import json
from pathlib import Path

STEPS_FILE = "rollout_steps.jsonl"


async def record_steps(ctx):
    from pool_rollout import pool_rollout  # examples/extend: the run's config is there

    record = {"step": ctx.step, "loop": ctx.config.rollout.loop}
    with open(Path(ctx.config.logging.run_dir) / STEPS_FILE, "a") as file:
        file.write(json.dumps(record) + "\n")
    return await pool_rollout(ctx)
