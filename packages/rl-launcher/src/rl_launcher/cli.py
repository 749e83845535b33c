"""Console scripts: ``rl-train`` and ``rl-plot``.

``rl-train --config run.yaml [--section.option VALUE ...] [--sglang-* ...] --print-config``
prints the resolved configuration. Training itself is not wired yet in this version (it
needs the engines, rollout and training backends of rl-sglang and rl-fsdp/rl-megatron), so
any other use of ``rl-train`` validates the config and then says so, instead of faking a run.
"""

import sys

USAGE = """usage: rl-train [--config FILE] [--section.option VALUE | section.option=VALUE ...]
                [--sglang-OPTION [VALUE] ...] [--megatron-OPTION [VALUE] ...] [--print-config]"""

NOT_IMPLEMENTED = (
    "rl-train: training runs are not implemented yet in this version of rl-launcher; "
    "missing: the Ray training actor group (rl-fsdp / rl-megatron backends), the rollout "
    "manager (rl-sglang engines, router, rollout functions, rl-rewards) and the sync / "
    "one-step-async / async loops with checkpoint and eval. The configuration is valid; "
    "`rl-train --print-config` shows it resolved."
)


def main(argv: list[str] | None = None) -> int:
    """``rl-train``: returns the process exit status (0 ok, 2 bad input or not available)."""
    from rl_launcher.config_loader import config_to_yaml, load_config

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    try:
        config, command_line = load_config(argv, flags=("--print-config",))
    except ValueError as error:
        print(f"rl-train: error: {error}", file=sys.stderr)
        return 2
    if "--print-config" in command_line.flags:
        print(config_to_yaml(config), end="")
        return 0
    print(NOT_IMPLEMENTED, file=sys.stderr)
    return 2


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
