"""``rl-convert``: HF <-> Megatron checkpoints at a TP/PP/EP layout, on CPU.

    rl-convert hf-to-megatron --hf Qwen3-8B/ --out qwen3-8b-megatron --tp 2 --pp 2
    rl-convert megatron-to-hf --ckpt qwen3-8b-megatron --out Qwen3-8B-back/
    rl-convert megatron-to-hf --ckpt ckpts/step_000100/trainer --config Qwen3-8B/ --out hf/

The ranks (tp · pp · ep processes, gloo on 127.0.0.1) are started here; outputs appear
atomically (written into a temporary sibling, renamed into place). Errors print one line
and exit 2 (bad arguments) or 1 (a rank failed).
"""

import argparse
import sys
import time

from rl_core.distributed import free_port
from rl_megatron import convert

EPILOG = """\
layouts: world = tp * pp * ep ranks on this machine (ep splits the experts of an MoE model
over data-parallel ranks). Megatron reshards on load: megatron-to-hf may use any layout
with the same padded vocabulary (multiples of 128 * tp); by default the saved one.
checkpoints: hf-to-megatron writes megatron-core's distributed format (torch_dist) of the
model's sharded state dict under 'model', with hf/ (config and tokenizer files) and
meta.json. megatron-to-hf also reads the backend's training checkpoints (give --config).
"""


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(
        prog="rl-convert",
        description="Convert model weights between Hugging Face and Megatron-core layouts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = main.add_subparsers(dest="command", required=True, metavar="COMMAND")
    to_megatron = commands.add_parser(
        "hf-to-megatron", help="an HF safetensors directory -> a Megatron distributed checkpoint"
    )
    to_megatron.add_argument("--hf", required=True, metavar="DIR", help="HF model directory")
    to_hf = commands.add_parser(
        "megatron-to-hf", help="a Megatron distributed checkpoint -> an HF safetensors directory"
    )
    to_hf.add_argument("--ckpt", required=True, metavar="DIR", help="Megatron checkpoint")
    to_hf.add_argument(
        "--config",
        metavar="DIR",
        help="HF directory with config.json (default: the checkpoint's hf/; needed for "
        "training checkpoints)",
    )
    for sub, layout in ((to_megatron, "1"), (to_hf, "the saved one")):
        sub.add_argument("--out", required=True, metavar="DIR", help="output directory")
        for name, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert")):
            sub.add_argument(
                f"--{name}", type=int, metavar="N", help=f"{what} parallel size (default {layout})"
            )
        sub.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", *convert.DTYPES],
            help="dtype written (default auto: the HF config's dtype, else float32)",
        )
        sub.add_argument("--overwrite", action="store_true", help="replace an existing output")
    return main


def plan_of(args) -> convert.Plan:
    if args.command == "hf-to-megatron":
        return convert.plan_hf_to_megatron(
            args.hf,
            args.out,
            tp=args.tp or 1,
            pp=args.pp or 1,
            ep=args.ep or 1,
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
    return convert.plan_megatron_to_hf(
        args.ckpt,
        args.out,
        config_dir=args.config,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )


def run(plan: convert.Plan) -> None:
    """Every rank of ``plan``, each a spawned process (one too: its failure then comes
    back like any rank's, as the exception's text)."""
    import logging

    import torch.multiprocessing as mp

    # its "Terminating process ... via SIGTERM" when one rank fails: the error says enough
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    mp.spawn(convert.run_rank, args=(plan, free_port()), nprocs=plan.world_size, join=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        plan = plan_of(args)
    except (ValueError, OSError) as error:
        print(f"rl-convert: error: {_one_line(error)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    try:
        run(plan)
    except (ProcessRaisedException, ProcessExitedException) as error:
        print(f"rl-convert: error: {plan.direction} failed: {_one_line(error)}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    print(f"rl-convert: wrote {plan.output} ({convert.describe(plan)}, {seconds:.1f} s)")
    return 0


def _one_line(error: BaseException) -> str:
    """The last line of an error (a spawned rank's carries its whole traceback)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
