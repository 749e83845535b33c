"""Console scripts: ``rl-train`` and ``rl-plot`` (``rl-eval`` is :mod:`rl_launcher.eval_cli`).

``rl-train --config run.yaml [--section.option VALUE ...] [--sglang-* ...] [--resume [STEP|PATH]]``
trains with the loop :mod:`rl_launcher.loops.dispatch` picks: the RL loop of
:mod:`rl_launcher.loops.rl` (train-only on dumped rollouts with ``rollout.replay_dir``),
SFT (``mode: sft``, :mod:`rl_launcher.loops.sft`) or rollout-only
(``rollout.rollout_only``, :mod:`rl_launcher.loops.rollout_only`); ``--print-config``
prints the resolved configuration instead. A reward that raises (unless skipped) exits with status 2.
Combinations that cannot run are refused with exit status 2 and a message saying so, and
so is a second run into a run directory in use (:mod:`rl_launcher.infra.run_lock`). SIGTERM or
SIGINT stops the run at a step boundary with a checkpoint and exits with 143 or 130
(:mod:`rl_launcher.infra.stopping`).
"""

import sys

from rl_launcher.loops.dispatch import run_mode

USAGE = """usage: rl-train [--config FILE] [--section.option VALUE | section.option=VALUE ...]
                [--sglang-OPTION [VALUE] ...] [--megatron-OPTION [VALUE] ...]
                [--resume [STEP|PATH]] [--print-config]"""
HELP = """
Train a policy with RL (or SFT) as the config says; options on the command line override
the YAML file's.

  --config FILE            YAML file of options (the defaults below fill the rest)
  --section.option VALUE   one option (also section.option=VALUE); values are YAML:
                           3, true, null, [1, 2]
  --sglang-OPTION [VALUE]  passed to SGLang servers verbatim (engine.kind=sglang)
  --megatron-OPTION [VALUE]
                           passed to the Megatron backend verbatim
  --resume [STEP|PATH]     continue from the newest loadable checkpoint, or step STEP, or
                           the checkpoint directory PATH
  --print-config           print the resolved, validated config as YAML and exit

Exit status: 0 done, 1 the run stopped on a fault, 2 bad input, 128 + N stopped by
signal N (SIGTERM, Ctrl-C: at a step boundary, with a checkpoint).

Options and their defaults, by group (what each means: docs/config.md, generated from the
config classes; rl-train --print-config shows a resolved config):
"""


def not_wired(config) -> str | None:
    """Why this valid config cannot run in this version, or None when it can."""
    if config.rollout.loop != "sync" and config.rollout.replay_dir:
        return (
            f"rollout.loop={config.rollout.loop!r} overlaps generation with training; "
            "a replay has no generation: use rollout.loop=sync"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    """``rl-train``: returns the process exit status (0 ok, 1 the run stopped on a fault,
    2 bad input or not available, 128 + N stopped by signal N). From the command line
    (``argv`` None) the process ends here with that status, without the interpreter's
    teardown (:func:`rl_launcher.infra.lifetime.exit_now`)."""
    if argv is None:
        from rl_launcher.infra.lifetime import exit_now

        exit_now(train_command(sys.argv[1:], exiting=True))
    return train_command(argv)


def train_command(argv: list[str], *, exiting: bool = False) -> int:
    """:func:`main` on ``argv``: the exit status. ``exiting``: the process ends right after
    (see :func:`run_training`)."""
    from rl_launcher.config.loader import config_to_yaml, load_config

    if "-h" in argv or "--help" in argv:
        from rl_launcher.config.docs import option_groups

        print(USAGE + "\n" + HELP + "\n" + option_groups())
        return 0
    try:
        config, command_line = load_config(
            argv, flags=("--print-config",), valued_flags=("--resume",)
        )
    except ValueError as error:
        print(f"rl-train: error: {error}", file=sys.stderr)
        return 2
    if "--print-config" in command_line.flags:
        print(config_to_yaml(config), end="")
        return 0
    if "--resume" in command_line.flags:  # a STEP or PATH, or the newest loadable one
        config.checkpoint.resume = command_line.flag_values.get("--resume", True)
    return run_training(config, exiting=exiting)


def run_training(config, *, exiting: bool = False) -> int:
    """Run ``config``: the exit status. ``exiting``: the process ends right after, so a
    Ray begun early that the run never took is left to die with it (its head processes
    are tied to the process) instead of being waited for and stopped, seconds more
    before a refusal that came after it began (a missing model or data file)."""
    from rl_launcher.infra.ray_cluster import check_before_ray, prepare_local_ray_env

    prepare_local_ray_env(config.cluster.ray_address)  # before the loop's modules import ray
    from rl_launcher.infra import faults, stopping
    from rl_launcher.infra.ray_cluster import start_early, stop_early
    from rl_launcher.infra.run_dirs import absolute_paths, prepare_run_dirs
    from rl_launcher.infra.run_lock import lock_run_dir
    from rl_launcher.roles.reward import RewardError
    from rl_launcher.session.run import check_before_start
    from rl_rewards import get_reward

    reason = not_wired(config)
    if reason is not None:
        print(f"rl-train: error: {reason}", file=sys.stderr)
        return 2
    # SIGTERM and SIGINT: stop at a step boundary with a checkpoint (rl_launcher.infra.stopping)
    stopping.install(config.checkpoint.stop_grace_s)
    lock = None
    absolute_paths(config)  # workers on other nodes open them: not relative to their cwd
    try:
        check_before_ray(config)  # GPUs and cluster address: seconds, not a wait inside Ray
        prepare_run_dirs(config)  # unwritable run / checkpoint directories, before the run
        lock = lock_run_dir(config.logging.run_dir)  # one run per directory, else exit 2
        get_reward(config.rollout.reward)  # an unknown reward fails before anything starts
        check_before_start(config)  # the loops' own checks, before Ray begins
        start_early(config)  # a local Ray starts while the loop imports torch, model, prompts
        run_mode(config)(config)
    except (ValueError, RewardError) as error:
        hint = " (rollout.on_reward_error=skip counts and skips such samples)"
        print(
            f"rl-train: error: {error}" + (hint if isinstance(error, RewardError) else ""),
            file=sys.stderr,
        )
        return 2
    except (faults.RunStopped, faults.TrainActorDied) as error:  # engines etc. already stopped
        print(f"rl-train: stopped: {faults.stop_message(config, error)}", file=sys.stderr)
        return 1
    except stopping.RunInterrupted as stop:  # engines, router and Ray already stopped
        print(f"rl-train: {stopping.stopped_message(config, stop)}", file=sys.stderr)
        return stop.exit_code
    finally:
        stop_early(wait=not exiting)  # a Ray begun early that the run never took
        stopping.uninstall()
        if lock is not None:
            lock.release()
    return 0


PLOT_HELP = """usage: rl-plot RUN_DIR

Write PNG charts of RUN_DIR/metrics.jsonl into RUN_DIR/plots (reward, eval pass@k, KL,
entropy, response length, the step-time split; each when its metrics exist) and print
their paths. rl-train writes the same charts at the end of a run. Exit status 0, or 2 on
bad input."""


def plot_main(argv: list[str] | None = None) -> int:
    """``rl-plot RUN_DIR``: write PNG charts of RUN_DIR/metrics.jsonl into RUN_DIR/plots."""
    from rl_launcher.plots import plot_run

    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(PLOT_HELP)
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(PLOT_HELP.splitlines()[0], file=sys.stderr)
        return 2
    try:
        written = plot_run(argv[0])
    except ValueError as error:
        print(f"rl-plot: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
