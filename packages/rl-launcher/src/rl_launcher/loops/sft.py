"""``mode=sft``: supervised fine-tuning through the same training actor group, no engines.

Each step reads like the algorithm:

    examples (prompt + response, loss on the response)  ->  per-rank batches by tokens
    ->  ``algorithm.num_minibatches`` optimizer steps of the SFT objective (rl-fsdp)

Metrics go to ``metrics.jsonl`` (``loss/sft``, ``train/*``, ``sft/*``, ``time/*``), a
progress line per step, checkpoints every ``checkpoint.interval`` steps and at the end
(trainer state + data position; ``checkpoint.save_hf`` adds an HF directory ``hf/`` that a
later RL run can start from with ``model.path``), ``--resume`` continues exactly.
"""

import contextlib
from pathlib import Path

from rl_core.batch import batch_from_samples
from rl_core.metrics import summarize
from rl_launcher.data.buffer import split_by_rank
from rl_launcher.infra import checkpoints, resume_choice, stopping
from rl_launcher.infra.run_log import MetricsLog, truncate_metrics
from rl_launcher.loops.extras import save_extras
from rl_launcher.loops.step import Clock, draw_charts, finish_step, minibatches
from rl_launcher.session.model import precision_note, prepare_model
from rl_launcher.session.run import Run, check_fresh
from rl_launcher.session.start import start_trainer


def train_sft(config, *, step_fn=None, to_sample=None) -> Path:
    """Run an SFT ``config`` to its last step; returns the run directory. DPO runs the
    same loop with its own step and row reader (:mod:`rl_launcher.loops.dpo`)."""
    step_fn = step_fn or sft_step
    chosen = resume_choice.chosen(config)  # before anything starts: a bad --resume fails fast
    with contextlib.closing(start_sft_run(config, to_sample=to_sample)) as run:
        first = resume_sft(run, chosen) + 1 if config.checkpoint.resume else 1
        with stopping.stepping(run, save_sft, first):  # SIGTERM / SIGINT: at a step boundary
            for step in range(first, config.num_steps + 1):
                finish_step(run, step, step_fn(run, step), save_sft)
    draw_charts(Path(config.logging.run_dir))
    return Path(config.logging.run_dir)


def start_sft_run(config, *, to_sample=None):
    """The run's starting model, example source (rows read by ``to_sample``, default
    SFT's) and training actor group (no engines)."""
    from rl_launcher.data.sft import build_sft_source, sft_sample_from_row

    run_dir = Path(config.logging.run_dir)
    check_fresh(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(config.model, run_dir=run_dir, seed=config.seed)
    precision_note(config)
    source = build_sft_source(
        config, tokenizer=tokenizer, to_sample=to_sample or sft_sample_from_row
    )
    run = Run(config=config, source=source, metrics_log=MetricsLog(run_dir, logging=config.logging))
    run._cleanup.append(run.metrics_log.close)
    run.extras["tokenizer"] = tokenizer  # DPO's held-out pairs are read with it
    try:
        start_trainer(run, model_dir)
    except BaseException:
        run.close()
        raise
    return run


def rank_batches(samples: list, num_ranks: int) -> list:
    """One packed batch of ``samples`` (step-wide denominators) split across ranks by tokens."""
    return split_by_rank(batch_from_samples(samples), samples, num_ranks)[1]


def sft_step(run, step: int = 0) -> dict[str, float]:
    config, clock = run.config, Clock()
    samples = run.source.next_batch(config.rollout.batch_size)
    batches = rank_batches(samples, run.num_ranks)
    clock.lap("data")
    metrics = run.trainer.train_steps(minibatches(batches, config.algorithm.num_minibatches))
    clock.lap("train")
    metrics |= summarize([s.response_length for s in samples], "sft/response_length")
    metrics["sft/num_tokens"] = float(sum(len(s.tokens) for s in samples))
    return metrics | clock.times()


def save_sft(run, step: int) -> Path:
    root = checkpoints.checkpoint_dir(run.config)
    path = checkpoints.step_path(root, step)
    path.mkdir(parents=True, exist_ok=True)
    run.trainer.save(str(path / "trainer"))
    save_extras(run, path)
    mode, data = run.config.mode, run.source.state_dict()
    checkpoints.write_state(path, {"step": step, "mode": mode, "data": data})
    checkpoints.prune(root, run.config.checkpoint.keep_last)
    return path


def resume_sft(run, found: tuple[Path, dict] | None) -> int:
    """Load ``found``, the checkpoint ``checkpoint.resume`` named and its state
    (:func:`resume_choice.chosen`); returns its step (0 when there is none)."""
    if found is None:
        print("rl-train: --resume found no complete checkpoint; starting at step 1", flush=True)
        return 0
    path, state = found
    if state.get("mode", "rl") != run.config.mode:
        raise ValueError(
            f"{path} is a checkpoint of a mode={state.get('mode', 'rl')} run; a "
            f"mode={run.config.mode} run cannot resume from it"
        )
    with resume_choice.loading(path):  # every error names the checkpoint
        run.trainer.load(str(path / "trainer"))
        run.source.load_state_dict(state["data"])
    root = checkpoints.checkpoint_dir(run.config)
    resume_choice.set_aside_after(root, int(state["step"]))  # the steps after it are redone
    dropped = truncate_metrics(run.config.logging.run_dir, int(state["step"]))
    print(
        f"rl-train: resumed from {path} (step {state['step']}; {dropped} later metrics "
        "records dropped)",
        flush=True,
    )
    return int(state["step"])
