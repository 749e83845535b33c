"""User code a run imports by dotted path ``pkg.module:function``: where it is looked for,
how each option's function is called, and the check that imports and signature-checks every
one of them before Ray starts (docs/extending.md lists them with examples).

One loader serves all: :func:`rl_core.registry.load_dotted`, on ``sys.path``, to which a
run adds its working directory and its config file's directory (:func:`add_import_dirs`);
PYTHONPATH works as usual. Both directories also go into ``PYTHONPATH`` for the processes
the run starts (reward workers, a local Ray's workers, training actors:
:func:`import_path_env`), so a module next to the config imports there too.
"""

import inspect
import os
import sys
from pathlib import Path

from rl_core.registry import CallShape, is_dotted, load_checked

# option -> how the run calls its function (the text is what a refusal shows)
HOOK_SHAPES = {
    "rollout.function": CallShape(
        3,
        (),
        "async fn(ctx: rl_sglang.rollout.generate.GenerateContext, sample: Sample, "
        "sampling_params: dict) -> Sample | list[Sample]",
    ),
    "rollout.group_reward": CallShape(
        1, (), "[async] fn(samples: list[Sample]) -> list[float] (one per sample, in order)"
    ),
    "rollout.sample_filter": CallShape(
        1, (), "fn(sample: Sample) -> bool (False leaves the sample out of training)"
    ),
    "rollout.post_process": CallShape(
        1,
        (),
        "fn(groups: list[list[Sample]]) -> list[list[Sample]] | None (None: changed in place)",
    ),
    "rollout.rollout_function": CallShape(
        1,
        (),
        "async fn(ctx: rl_launcher.roles.rollout_context.RolloutContext) -> list[list[Sample]] "
        "(ctx.num_groups groups, each drawn with ctx.next_prompt())",
    ),
    "logging.rollout_log_function": CallShape(
        2, (), "fn(step: int, groups: list[list[Sample]]) -> dict[str, float]"
    ),
    "data.source": CallShape(
        1,
        ("seed", "tokenizer"),
        "class Source(data: DataConfig, *, seed: int, tokenizer) with next_prompt() -> "
        "Sample, state_dict() -> dict (JSON) and load_state_dict(state: dict)",
    ),
}
SOURCE_METHODS = ("next_prompt", "state_dict", "load_state_dict")


def add_import_dirs(*dirs: str | Path) -> None:
    """Put ``dirs`` first on ``sys.path`` and in ``PYTHONPATH`` (for child processes)."""
    for directory in reversed([str(Path(d).resolve()) for d in dirs]):
        if directory not in sys.path:
            sys.path.insert(0, directory)
        entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
        if directory not in entries:
            os.environ["PYTHONPATH"] = os.pathsep.join([directory, *entries])


def run_import_dirs(config_path: str | None) -> list[Path]:
    """Where a run's dotted paths are looked for first: the working directory and the
    config file's directory."""
    dirs = [Path.cwd()]
    if config_path is not None:
        dirs.append(Path(config_path).resolve().parent)
    return dirs


def import_path_env() -> dict[str, str]:
    """``{"PYTHONPATH": ...}`` for a Ray actor's ``runtime_env`` env_vars (empty if unset)."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": path} if path else {}


def option_value(config, name: str):
    section, field = name.split(".")
    return getattr(getattr(config, section), field)


def load_hook(config, name: str):
    """The function of option ``name`` (a key of :data:`HOOK_SHAPES`), or None when unset."""
    path = option_value(config, name)
    if path is None or (name == "rollout.function" and path == "default"):
        return None
    if not is_dotted(path):
        raise ValueError(f"{name}={path!r} is not a dotted path like 'my_pkg.module:function'")
    return load_checked(path, HOOK_SHAPES[name], name)


def check_extensions(config) -> None:
    """Import and signature-check every user function the config names (before Ray)."""
    for name in HOOK_SHAPES:
        target = load_hook(config, name)
        if name == "data.source" and target is not None:
            _check_source(config.data.source, target)
    check_reward(config.rollout.reward, config.rollout.reward_options)


def _check_source(path: str, cls) -> None:
    missing = [m for m in SOURCE_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(
            f"data.source {path!r} has no {', '.join(missing)}; expected "
            f"{HOOK_SHAPES['data.source'].text}"
        )


def takes_sample(fn) -> bool:
    """Whether a reward's first parameter is named ``sample`` (it gets the whole Sample)."""
    try:
        parameters = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool(parameters) and parameters[0] == "sample"


def check_reward(name: str, options: dict) -> None:
    """ValueError naming rollout.reward / rollout.reward_options when the reward cannot be
    loaded, cannot be called as the run calls it, or does not take exactly these options
    (unknown names refused with the ones it accepts; required ones it lacks named)."""
    from rl_rewards import get_reward

    try:
        fn = get_reward(name)
    except ValueError as error:
        raise ValueError(f"rollout.reward: {error}") from None
    positional = ("sample",) if takes_sample(fn) else ("response", "label")
    accepted, required, any_keyword = _keyword_options(fn, len(positional))
    unknown = sorted(set(options) - set(accepted)) if not any_keyword else []
    if unknown:
        raise ValueError(
            f"rollout.reward_options: reward {name!r} takes no option {', '.join(unknown)}; "
            f"its options: {', '.join(accepted) or 'none'}"
        )
    missing = [option for option in required if option not in options]
    if missing:
        raise ValueError(
            f"rollout.reward_options: reward {name!r} needs {', '.join(missing)} "
            f"(e.g. rollout.reward_options: {{{missing[0]}: ...}})"
        )
    shape = CallShape(len(positional), tuple(options), f"fn({', '.join(positional)}, **options)")
    refusal = shape.refusal(fn)
    if refusal is not None:
        raise ValueError(
            f"rollout.reward {name!r}: {refusal}; expected [async] fn(response: str, label, "
            "**options) or [async] fn(sample: Sample, **options) -> float | dict"
        )


def _keyword_options(fn, num_positional: int) -> tuple[list[str], list[str], bool]:
    """(names a reward accepts as options, those without a default, takes **kwargs)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())[num_positional:]
    except (TypeError, ValueError):
        return [], [], True
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p for p in parameters if p.kind in kinds]
    required = [p.name for p in named if p.default is inspect.Parameter.empty]
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return [p.name for p in named], required, any_keyword
