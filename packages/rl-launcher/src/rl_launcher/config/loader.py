"""Build a :class:`TrainConfig` from YAML plus command-line overrides, validated once.

Overrides: ``--section.option VALUE``, ``--section.option=VALUE`` or ``section.option=VALUE``
(values parsed as YAML: ``3``, ``true``, ``null``, ``[1, 2]``). ``--sglang-*`` and
``--megatron-*`` options are collected verbatim into ``engine.sglang_args`` and
``backend.extra_args``. Every error names the bad field and what it accepts.
"""

import dataclasses
import difflib
import math
import operator
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from rl_core.registry import Registry, is_dotted
from rl_launcher.config import BOUNDS, TrainConfig
from rl_launcher.config.checks import check_consistency
from rl_launcher.config.extensions import add_import_dirs, run_import_dirs

PASSTHROUGH_PREFIXES = {
    "--sglang-": ("engine", "sglang_args"),
    "--megatron-": ("backend", "extra_args"),
}


@dataclass
class CommandLine:
    """argv split into its parts: flags, the config file, overrides and passthrough options."""

    config_path: str | None = None
    flags: set[str] = field(default_factory=set)
    flag_values: dict[str, str] = field(default_factory=dict)  # of switches given a value
    overrides: list[tuple[str, str]] = field(default_factory=list)
    passthrough: dict[tuple[str, str], list[str]] = field(default_factory=dict)


def parse_command_line(
    argv: list[str], *, flags: tuple[str, ...] = (), valued_flags: tuple[str, ...] = ()
) -> CommandLine:
    """Split ``argv``; ``flags`` are value-less switches such as ``--print-config``;
    ``valued_flags`` switches that may take one value (``--resume [STEP|PATH]``,
    ``--resume=VALUE``): the next token unless it starts with ``-`` or holds ``=``."""
    parsed, i = CommandLine(), 0
    while i < len(argv):
        token = argv[i]
        if token in flags:
            parsed.flags.add(token)
        elif (name := token.split("=", 1)[0]) in valued_flags:
            parsed.flags.add(name)
            following = argv[i + 1 : i + 2]
            if "=" in token:
                parsed.flag_values[name] = token.split("=", 1)[1]
            elif following and not following[0].startswith("-") and "=" not in following[0]:
                parsed.flag_values[name], i = following[0], i + 1
        elif token in ("--config", "-c") or token.startswith("--config="):
            parsed.config_path, i = _value_of(argv, i, "--config")
        elif target := _passthrough_target(token):
            has_value = "=" not in token and _is_passthrough_value(argv[i + 1 : i + 2])
            parsed.passthrough.setdefault(target, []).extend(argv[i : i + 1 + has_value])
            i += has_value
        elif ("=" in token and not token.startswith("-")) or token.startswith("--"):
            key, value, i = _override_of(argv, i)
            parsed.overrides.append((key, value))
        else:
            raise ValueError(
                f"unrecognised argument {token!r}; overrides look like --section.option VALUE "
                "or section.option=VALUE (see rl-train --print-config)"
            )
        i += 1
    return parsed


def _passthrough_target(token: str) -> tuple[str, str] | None:
    return next((t for p, t in PASSTHROUGH_PREFIXES.items() if token.startswith(p)), None)


def _is_passthrough_value(following: list[str]) -> bool:
    """Whether the token after a passthrough option is its value (not an option/override)."""
    if not following or following[0].startswith("--"):
        return False
    key = following[0].split("=", 1)[0]
    return not ("=" in following[0] and "." in key)  # section.option=VALUE is ours


def _value_of(argv: list[str], i: int, name: str) -> tuple[str, int]:
    if "=" in argv[i]:
        return argv[i].split("=", 1)[1], i
    if i + 1 >= len(argv):
        raise ValueError(f"{name} needs a value")
    return argv[i + 1], i + 1


def _override_of(argv: list[str], i: int) -> tuple[str, str, int]:
    token = argv[i].removeprefix("--")
    if "=" in token:
        key, value = token.split("=", 1)
    else:
        if i + 1 >= len(argv):
            raise ValueError(f"option --{token} needs a value, e.g. --{token} VALUE")
        key, value, i = token, argv[i + 1], i + 1
    return key.replace("-", "_"), value, i


def load_config(
    argv: list[str] | None = None,
    *,
    flags: tuple[str, ...] = (),
    valued_flags: tuple[str, ...] = (),
) -> tuple[TrainConfig, CommandLine]:
    """The validated config of a command line, and the parsed command line."""
    command_line = parse_command_line(list(argv or []), flags=flags, valued_flags=valued_flags)
    add_import_dirs(*run_import_dirs(command_line.config_path))  # for pkg.module:function
    tree: dict[str, Any] = {}
    if command_line.config_path is not None:
        tree = read_yaml(command_line.config_path)
    for key, raw in command_line.overrides:
        set_dotted(tree, key, parse_value(raw, key))
    for (section, name), args in command_line.passthrough.items():
        existing = tree.setdefault(section, {}).get(name) or []
        tree[section][name] = [*existing, *args]
    return config_from_tree(tree), command_line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (PyYAML keeps the last one silently, so one of two settings would be lost)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, list | dict):
                continue  # unhashable: PyYAML's own error names it below
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (each option may be set once)",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_value(raw: str, where: str = "value") -> Any:
    """A command-line value as YAML (``3``, ``true``, ``[1, 2]``); text that is not YAML
    stays text, and the field's type check judges it. ``where`` names it in errors."""
    try:
        return yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else raw
    except yaml.constructor.ConstructorError as error:
        raise ValueError(f"{where}: {error.problem} in {raw!r}") from None
    except yaml.YAMLError:
        return raw


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in YAML file ``path``; a syntax error or a duplicate key is a
    ValueError naming the file, line and column."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        tree = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as error:
        raise ValueError(_yaml_error_message(path, error)) from None
    if not isinstance(tree, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level")
    return tree


def _yaml_error_message(path: Path, error: yaml.YAMLError) -> str:
    """One line: ``file:line:column: problem (context at line, column)``; lines and
    columns count from 1. The context is where the unfinished construct began."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and start is not None:
        context += f" that began at line {start.line + 1}, column {start.column + 1}"
    return f"config file {where}: {problem}" + (f" ({context})" if context else "")


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``tree[a][b][c] = value`` for ``a.b.c``; list items are addressed by index."""
    *parents, last = dotted.split(".")
    node: Any = tree
    for depth, key in enumerate(parents):
        if isinstance(node, list):
            node = node[_list_index(node, key, parents[: depth + 1])]
            continue
        if not isinstance(node.get(key, {}), dict | list):
            raise ValueError(f"option {'.'.join(parents[: depth + 1])} is a value, not a section")
        node = node.setdefault(key, {})
    if isinstance(node, list):
        node[_list_index(node, last, dotted.split("."))] = value
    else:
        node[last] = value


def _list_index(items: list, key: str, path: list[str]) -> int:
    if not key.isdigit() or int(key) >= len(items):
        raise ValueError(f"{'.'.join(path)}: list index must be 0..{len(items) - 1}")
    return int(key)


def config_from_tree(tree: dict[str, Any]) -> TrainConfig:
    config = build(TrainConfig, tree, "")
    check_consistency(config)
    return config


def build(cls: type, data: Any, where: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking keys, types, choices and bounds."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping of options, got {data!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ValueError(_unknown_key_message(where, key, list(known)))
    hints = get_type_hints(cls)
    values = {}
    for name, spec in known.items():
        path = f"{where}.{name}" if where else name
        if name in data:
            values[name] = _check_rules(spec, _coerce(data[name], hints[name], path), path)
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ValueError(f"missing required option {path}")
    return cls(**values)


def _unknown_key_message(where: str, key: str, known: list[str]) -> str:
    path = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown option {path!r}; {hint}options of {where or 'the config'}: {', '.join(known)}"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, where)
            except ValueError as error:
                if dataclasses.is_dataclass(option):
                    raise error from None  # a nested message says more than the union
        raise ValueError(f"{where}: expected {type_name(hint)}, got {value!r}")
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if origin is list and isinstance(value, list):
        return [_coerce(item, args[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict and isinstance(value, dict):
        return dict(value)
    if hint is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if (
        isinstance(hint, type)
        and isinstance(value, hint)
        and not (hint is int and isinstance(value, bool))
    ):
        return value
    raise ValueError(f"{where}: expected {type_name(hint)}, got {value!r} ({type(value).__name__})")


def type_name(hint: Any) -> str:
    """Readable type: ``list[DatasetConfig]``, ``int or null``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if hint is Any:
        return "any"
    return "null" if hint is type(None) else hint.__name__


def _check_rules(spec: dataclasses.Field, value: Any, where: str) -> Any:
    choices = spec.metadata.get("choices")
    if isinstance(value, str) and is_dotted(value) and _dotted_loader(spec) is not None:
        try:
            _dotted_loader(spec)(value)  # imported and its signature checked
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        return value
    if choices is not None and value is not None:
        allowed = choices.names() if isinstance(choices, Registry) else list(choices)
        if value not in allowed:
            raise ValueError(
                f"{where}: {value!r} is not allowed; choose one of: {', '.join(allowed)}"
            )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: must be a finite number, got {value}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        check_bounds(value, spec.metadata, where)
    return value


def _dotted_loader(spec: dataclasses.Field):
    """How a dotted path in this field is loaded, or None when the field takes none."""
    choices = spec.metadata.get("choices")
    if isinstance(choices, Registry) and choices.shape is not None:
        return choices.get
    return spec.metadata.get("dotted")


_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def check_bounds(value: float, rules: dict[str, Any], where: str) -> None:
    """ValueError naming ``where`` when ``value`` breaks a bound of ``rules`` (see BOUNDS)."""
    for name, (sign, _) in BOUNDS.items():
        bound = rules.get(name)
        if bound is not None and not _COMPARE[sign](value, bound):
            raise ValueError(f"{where}: must be {sign} {bound}, got {value}")


def choice_names(spec: dataclasses.Field) -> list[str] | None:
    """The allowed values of a field, or None when any value of its type goes."""
    choices = spec.metadata.get("choices")
    if choices is None:
        return None
    return choices.names() if isinstance(choices, Registry) else list(choices)


def config_to_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False, default_flow_style=False)
