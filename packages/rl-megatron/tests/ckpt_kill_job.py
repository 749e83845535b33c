"""``python ckpt_kill_job.py DIR POINT``: save a checkpoint to DIR/ckpt, then overwrite it
and block at POINT inside the save ("writing": the rank file on disk, no meta.json yet;
"swapping": the previous checkpoint moved aside, the new one not in place) until the test
SIGKILLs this process. A world of one without a process group, as on one host."""

import os
import sys
import time
from pathlib import Path

import torch

from rl_megatron import checkpoint

META = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "mode": "policy"}


def state(step: int) -> dict:
    return {"model": {"w": torch.full((256, 256), float(step))}, "step": step}


def block(workdir: Path) -> None:
    (workdir / "blocked").write_text(str(os.getpid()))
    time.sleep(3600)


def block_at(point: str, workdir: Path) -> None:
    if point == "writing":  # the barrier after every rank's torch.save
        barrier, calls = checkpoint._barrier, []
        checkpoint._barrier = lambda: (
            calls.append(1),
            len(calls) == 2 and block(workdir),
            barrier(),
        )
        return
    replace = os.replace

    def blocking_replace(src, dst):
        if str(src).endswith(".partial"):
            block(workdir)
        return replace(src, dst)

    os.replace = blocking_replace


if __name__ == "__main__":
    workdir, point = Path(sys.argv[1]), sys.argv[2]
    checkpoint.save_sharded(workdir / "ckpt", state(1), META)
    block_at(point, workdir)
    checkpoint.save_sharded(workdir / "ckpt", state(2), META)
