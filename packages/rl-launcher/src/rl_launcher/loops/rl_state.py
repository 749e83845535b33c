"""What an RL run hands on between its parts: the trainer's weights into the engines
(:func:`sync`), and its state into a checkpoint and back (:func:`save`, :func:`resume`):
trainer and critic, the data position (with the prompts drawn but not trained) and the
weight version."""

from pathlib import Path

from rl_launcher.infra import checkpoints, data_order, resume_choice
from rl_launcher.infra.run_log import truncate_metrics
from rl_launcher.loops.extras import load_extras, save_extras
from rl_launcher.loops.train_phase import REFERENCE_SAVED
from rl_launcher.roles.lora import serve_adapter
from rl_launcher.session.run import Run


def sync(run: Run, *, version: int) -> dict[str, float]:
    """Trainer weights into every engine; the engines then report ``version``."""
    engines = run.rollout.engines
    engines.wait_for_restarts()  # a dead engine is back first
    synced = run.trainer.sync_weights(engines.urls, str(version), **run.sync_options)
    engines.confirm_version(version)  # every engine reports it; a restarted one is given it
    serve_adapter(run, version)  # LoRA adapters synced: requests name this version's
    return synced | {"sync/weight_version": float(version)}


def save(run: Run, step: int) -> None:
    root = checkpoints.checkpoint_dir(run.config)
    path = checkpoints.step_path(root, step)
    path.mkdir(parents=True, exist_ok=True)
    run.trainer.save(str(path / "trainer"))
    save_extras(run, path)  # critic, HF export
    data = run.rollout.data_state()  # prompts in flight (async loops) are drawn again on resume
    state = {
        "step": step,
        "weight_version": step,
        "data": data["source"],
        "pending_prompts": data["pending"],
        REFERENCE_SAVED: True,  # a refreshed KL reference is in trainer/ (backends save it)
    }
    checkpoints.write_state(path, state)
    checkpoints.prune(root, run.config.checkpoint.keep_last)


def resume(run: Run, found: tuple[Path, dict] | None) -> int:
    """Load ``found``, the checkpoint ``checkpoint.resume`` named and its state
    (:func:`resume_choice.chosen`); returns its step (0 when there is none)."""
    if found is None:
        print("rl-train: --resume found no complete checkpoint; starting at step 1", flush=True)
        return 0
    path, state = found
    with resume_choice.loading(path):  # every error names the checkpoint
        run.trainer.load(str(path / "trainer"))
        load_extras(run, path, state)  # critic
        pending = state.get("pending_prompts", [])
        run.rollout.load_data_state({"source": state["data"], "pending": pending})
        version = int(state["weight_version"])
    root = checkpoints.checkpoint_dir(run.config)
    resume_choice.set_aside_after(root, int(state["step"]))  # the steps after it are redone
    sync(run, version=version)
    dropped = truncate_metrics(run.config.logging.run_dir, int(state["step"]))
    data_order.truncate(run.config.logging.run_dir, int(state["step"]))
    print(
        f"rl-train: resumed from {path} (step {state['step']}; {dropped} later metrics "
        "records dropped)",
        flush=True,
    )
    return int(state["step"])
