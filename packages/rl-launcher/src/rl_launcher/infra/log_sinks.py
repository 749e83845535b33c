"""Optional metric sinks beside ``metrics.jsonl``: TensorBoard and Weights & Biases.

Both are optional extras, imported only when enabled (``logging.tensorboard``,
``logging.wandb``); a missing one raises ValueError naming the extra to install.
TensorBoard events go to ``<run_dir>/tensorboard``; wandb writes under ``<run_dir>/wandb``
and, with ``logging.wandb_mode=offline`` (the default), never touches the network
(``wandb sync`` uploads the run later).
"""

import importlib
import os
from pathlib import Path
from typing import Any

INSTALL_HINT = "install it with: pip install 'rl-launcher[{extra}]' (or uv sync --extra {extra})"


def require(module: str, extra: str) -> Any:
    """``import module`` or a ValueError saying which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ValueError(
            f"logging.{extra}=true needs the {module!r} package; {INSTALL_HINT.format(extra=extra)}"
        ) from error


class TensorBoardSink:
    """Scalars to a TensorBoard event file, flushed after every step."""

    def __init__(self, log_dir: Path):
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if key != "step":
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run per training run; ``mode`` online, offline or disabled."""

    def __init__(self, run_dir: Path, *, project: str, mode: str, config: dict | None = None):
        wandb = require("wandb", "wandb")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=project,
            mode=mode,
            dir=str(run_dir),
            config=config,
            name=run_dir.name,
            reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(logging, run_dir: Path) -> list:
    """The sinks ``logging`` enables (possibly none)."""
    sinks: list = []
    if logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if logging.wandb:
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE", logging.wandb_mode)
        sinks.append(WandbSink(run_dir, project=logging.wandb_project, mode=mode))
    return sinks
