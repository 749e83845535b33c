"""Console scripts: ``rl-train`` and ``rl-plot``.

``rl-train --config run.yaml [--section.option VALUE ...] [--sglang-* ...] [--resume]``
trains (the synchronous loop of :mod:`rl_launcher.run.loop`); ``--print-config`` prints the
resolved configuration instead. Parts not wired yet (one-step-async and async loops, SFT,
Megatron, real SGLang engines) are refused with exit status 2 and a message saying so.
"""

import sys

USAGE = """usage: rl-train [--config FILE] [--section.option VALUE | section.option=VALUE ...]
                [--sglang-OPTION [VALUE] ...] [--megatron-OPTION [VALUE] ...]
                [--resume] [--print-config]"""


def not_wired(config) -> str | None:
    """Why this valid config cannot run in this version, or None when it can."""
    if config.rollout.loop != "sync":
        return f"rollout.loop={config.rollout.loop!r} is not implemented yet; use sync"
    if config.mode != "rl":
        return "mode=sft is not implemented in rl-train yet; use mode=rl"
    if config.rollout.dump_dir or config.rollout.replay_dir or config.rollout.rollout_only:
        return "rollout dumps, replay and rollout-only mode are not implemented yet"
    if config.algorithm.advantage_estimator == "gae":
        return "advantage_estimator=gae needs a critic, not wired into rl-train yet"
    if config.eval.interval:
        return "eval.interval > 0: evaluation is not wired into rl-train yet; set it to 0"
    return None


def main(argv: list[str] | None = None) -> int:
    """``rl-train``: returns the process exit status (0 ok, 2 bad input or not available)."""
    from rl_launcher.config_loader import config_to_yaml, load_config

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    try:
        config, command_line = load_config(argv, flags=("--print-config", "--resume"))
    except ValueError as error:
        print(f"rl-train: error: {error}", file=sys.stderr)
        return 2
    if "--print-config" in command_line.flags:
        print(config_to_yaml(config), end="")
        return 0
    if "--resume" in command_line.flags:
        config.checkpoint.resume = True
    return run_training(config)


def run_training(config) -> int:
    import signal

    from rl_launcher.ray_cluster import prepare_local_ray_env

    prepare_local_ray_env(config.cluster.ray_address)  # before the loop's modules import ray
    from rl_launcher.run.loop import train

    reason = not_wired(config)
    if reason is not None:
        print(f"rl-train: error: {reason}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so engines, router and Ray are stopped on the way out
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        train(config)
    except ValueError as error:
        print(f"rl-train: error: {error}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def plot_main(argv: list[str] | None = None) -> int:
    """``rl-plot RUN_DIR``: write PNG charts of RUN_DIR/metrics.jsonl into RUN_DIR/plots."""
    from rl_launcher.plots import plot_run

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: rl-plot RUN_DIR", file=sys.stderr)
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
