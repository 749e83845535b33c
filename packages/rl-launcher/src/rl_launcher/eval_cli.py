"""``rl-eval``: evaluate a model on datasets with the run's engines, sampling and reward.

    rl-eval --config run.yaml --model PATH [--dataset FILE ...] [--output FILE]
            [--section.option VALUE ...]

``PATH`` is a Hugging Face directory, a checkpoint directory or a run directory (its newest
complete checkpoint); a checkpoint's ``hf/`` export is used, or written first from its
trainer state (rl-fsdp runs; ``checkpoint.save_hf=true`` writes it during training).
Datasets are ``eval.datasets`` of the config, or the ``--dataset`` files instead. Engines
and the router start here and stop at the end; the summary (model, datasets, metrics) is
printed as JSON and written atomically to ``--output``, by default ``eval_summary.json`` in
the run directory ``PATH`` belongs to (:func:`run_dir_of`), with the engines' logs in
``eval_logs/`` beside it. Nothing goes into the config's ``logging.run_dir``: that
directory belongs to the run the config describes, which may be running. Rewards are
scored as in training (``rollout.reward_timeout_s``, ``rollout.on_reward_error``).
Exit status 0, or 2 on bad input.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

USAGE = """usage: rl-eval --config FILE --model PATH [--dataset FILE ...] [--output FILE]
               [--section.option VALUE | section.option=VALUE ...]

Evaluate a model with the config's engines, sampling and reward: pass@k and reward
statistics per dataset, printed as JSON.

  --config FILE    the run's YAML config (engine, rollout sampling, reward, eval.* options)
  --model PATH     what to evaluate: a run directory (its newest complete checkpoint), a
                   checkpoint directory (.../checkpoints/step_N) or a Hugging Face model
                   directory; a checkpoint without an hf/ export gets one written first
                   (rl-fsdp runs)
  --dataset FILE   an eval set (JSONL or Parquet, prompt and label); repeat for several;
                   default: the config's eval.datasets
  --output FILE    the JSON summary; default: eval_summary.json in the run directory PATH
                   belongs to (needed for a model outside a run); the engines' logs go to
                   eval_logs/ beside it. Nothing is written into the config's
                   logging.run_dir.
  --section.option VALUE   any option of the config (docs/config.md lists them all)

Exit status 0, or 2 on bad input (one line on stderr)."""
OWN_OPTIONS = ("--model", "--dataset", "--output")


def split_options(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """``rl-eval``'s own options, and the rest (for the config loader)."""
    own: dict[str, list[str]] = {name: [] for name in OWN_OPTIONS}
    rest, i = [], 0
    while i < len(argv):
        if argv[i] in OWN_OPTIONS:
            if i + 1 >= len(argv):
                raise ValueError(f"{argv[i]} needs a value")
            own[argv[i]].append(argv[i + 1])
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    if len(own["--model"]) != 1 or len(own["--output"]) > 1:
        raise ValueError("give --model PATH once (and --output FILE at most once)")
    return own, rest


def resolve_model_dir(path: str | Path, config=None) -> Path:
    """The HF directory of an HF dir, a checkpoint dir or a run dir (its newest checkpoint).
    A checkpoint without ``hf/`` is exported first when ``config`` (the run's) is given."""
    from rl_launcher.infra import checkpoints

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    done = checkpoints.complete_checkpoints(path / "checkpoints")
    step_dir = done[-1][1] if done else path
    if (step_dir / "hf" / "config.json").is_file():
        return step_dir / "hf"
    if config is not None and (step_dir / checkpoints.STATE_FILE).is_file():
        return export_checkpoint(step_dir, config)
    raise ValueError(
        f"{str(path)!r} is not an HF directory, nor a checkpoint or run directory with an HF "
        "export (train with checkpoint.save_hf=true to write one)"
    )


def export_checkpoint(step_dir: Path, config) -> Path:
    """Write ``<step_dir>/hf`` from the trainer state of an rl-fsdp checkpoint, in this
    process (one CPU rank; the checkpoint may come from any number of ranks)."""
    import dataclasses

    from rl_core.distributed import init_distributed
    from rl_fsdp import FSDPBackend
    from rl_launcher.roles.backends import fsdp_config

    base = Path(config.model.path) if config.model.path else step_dir.parents[1] / "initial_model"
    if not (base / "config.json").is_file():
        base = Path(config.logging.run_dir) / "initial_model"
    if config.backend.name != "fsdp" or not (base / "config.json").is_file():
        raise ValueError(
            f"{step_dir} has no hf/ export and its starting model was not found (fsdp runs "
            "only: model.path or <run_dir>/initial_model); train with checkpoint.save_hf=true"
        )
    trainer_config = dataclasses.replace(
        fsdp_config(config, model_dir=base),
        device="cpu",
        precision="fp32",
        reference=False,
        ref_offload=False,
    )
    import torch.distributed as dist

    joined = not dist.is_initialized()  # leave the process as it was found
    try:
        dist_info = init_distributed(device="cpu", rank=0, world_size=1)
        backend = FSDPBackend(trainer_config, dist_info=dist_info)
        backend.load_checkpoint(step_dir / "trainer")
        backend.export_hf(step_dir / "hf")
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()
    return step_dir / "hf"


def run_dir_of(path: str | Path) -> Path | None:
    """The run directory ``path`` belongs to: itself or the nearest of its three parents
    holding ``metrics.jsonl`` (a run, a checkpoint ``<run>/checkpoints/step_N`` or its
    ``hf/``, the run's ``initial_model``); None for a model outside any run."""
    path = Path(path).resolve()
    for candidate in (path, *path.parents[:3]):
        if (candidate / "metrics.jsonl").is_file():
            return candidate
    return None


def output_path(model: str, output: str | None) -> Path:
    """Where the summary goes (see the module docstring); checked writable now, before any
    engine starts (ValueError with the fix)."""
    if output is None:
        run_dir = run_dir_of(model)
        if run_dir is None:
            raise ValueError(
                f"--model {model!r} is not inside a run directory (no metrics.jsonl in it or "
                "its parents), so there is no run to write the summary into: give --output "
                "FILE (rl-eval never writes into the config's logging.run_dir)"
            )
        output = run_dir / "eval_summary.json"
    path = Path(output)
    if path.is_dir():
        raise ValueError(f"--output {str(path)!r} is a directory; give a file name in it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise ValueError(f"--output {str(path)!r}: cannot write there ({error})") from error
    return path


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def evaluate(config, model_dir: Path, *, log_dir: Path) -> dict:
    """Start engines on ``model_dir`` (their logs in ``log_dir``), evaluate
    ``config.eval.datasets``, stop; the summary. The engines' rollout scores with the
    evaluator's reward: one set of reward processes."""
    from rl_launcher.roles.evaluation import Evaluator
    from rl_launcher.session.model import load_tokenizer
    from rl_launcher.session.start import start_engines

    tokenizer_dir = model_dir if (model_dir / "tokenizer_config.json").is_file() else None
    tokenizer = load_tokenizer(tokenizer_dir or config.model.tokenizer_path or model_dir)
    evaluator = Evaluator(config, tokenizer)
    cleanup: list = [evaluator.close]
    try:
        manager = start_engines(
            config,
            model_dir=model_dir,
            tokenizer=tokenizer,
            source=None,
            log_dir=log_dir,
            cleanup=cleanup,
            reward=evaluator.reward_fn,
        )
        url = manager.engines.url
        metrics = evaluator.evaluate(url)
    finally:
        for stop in reversed(cleanup):
            stop()
    datasets = {name: len(prompts) for name, prompts in evaluator.datasets.items()}
    return {"model": str(model_dir), "datasets": datasets, "metrics": metrics}


def main(argv: list[str] | None = None) -> int:
    from rl_launcher.config import DatasetConfig
    from rl_launcher.config.loader import load_config
    from rl_launcher.roles.reward import RewardError

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    try:
        own, rest = split_options(argv)
        config, _ = load_config(rest)
        if own["--dataset"]:
            config.eval.datasets = [DatasetConfig(path=p) for p in own["--dataset"]]
        if not config.eval.datasets:
            raise ValueError("no eval datasets: set eval.datasets in the config or give --dataset")
        output = output_path(own["--model"][0], (own["--output"] or [None])[0])
        model_dir = resolve_model_dir(own["--model"][0], config)
        summary = evaluate(config, model_dir, log_dir=output.parent / "eval_logs")
    except (ValueError, RewardError) as error:
        print(f"rl-eval: error: {error}", file=sys.stderr)
        return 2
    write_json_atomic(output, summary)
    print(json.dumps(summary, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
