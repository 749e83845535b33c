"""torch.compile of a module's ``forward`` in place, falling back to eager per class.

Both training backends compile their transformer layers this way (rl-fsdp's HF decoder
layers in ``rl_fsdp.fusion``, rl-megatron's layers in ``rl_megatron.compiled_layers``);
what differs between them (which dimensions are dynamic, what happens to the output, how
a failure is told) is what their subclasses of :class:`CompiledOrEager` override.
"""

import torch

COMPILE_FAILURES: list[str] = []  # "Class: error" of every class fallen back to eager
RECOMPILE_LIMIT = 64  # graphs per code object: shapes x grad mode x module kinds


class CompiledOrEager:
    """A module's ``forward`` replacement: its compiled forward, or the eager one once a
    compiled call of any module of the same class (in ``failed_classes``, shared by one
    compile pass: a class fails once, not once per layer) has raised. ``fallback`` runs
    once, before the first eager call after a failure. Inside another compiled module it
    runs eager, so that the outer graph traces it inline."""

    def __init__(
        self, module, *, backend, failed_classes: set, dynamic: bool | None = None, fallback=None
    ):
        self.eager = module.forward
        self.compiled = torch.compile(self.eager, backend=backend, dynamic=dynamic)
        self.name = type(module).__name__
        self.failed_classes = failed_classes
        self.fallback = fallback

    @property
    def failed(self) -> bool:
        return self.name in self.failed_classes

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.eager(*args, **kwargs)
        if not self.failed:
            self.mark_dynamic(args, kwargs)
            try:
                output = self.compiled(*args, **kwargs)
            except Exception as error:  # a compile (or compiled-run) failure: eager from now on
                self.failed_classes.add(self.name)
                COMPILE_FAILURES.append(f"{self.name}: {error!r}"[:400])
                self.report_failure(error)
            else:
                return self.finish(output)
        if self.fallback is not None:
            self.fallback, fallback = None, self.fallback
            fallback()
        return self.eager(*args, **kwargs)

    def mark_dynamic(self, args: tuple, kwargs: dict) -> None:
        """Mark the dimensions that vary between calls dynamic (none by default)."""

    def finish(self, output):
        """The compiled forward's output as the caller gets it (unchanged by default)."""
        return output

    def report_failure(self, error: Exception) -> None:
        """Tell that this class now runs eager (subclasses warn or log)."""


def wrapped_forwards(modules) -> list[CompiledOrEager]:
    """The :class:`CompiledOrEager` forwards installed on ``modules``."""
    forwards = (m.__dict__.get("forward") for m in modules)
    return [f for f in forwards if isinstance(f, CompiledOrEager)]


def raise_recompile_limit() -> None:
    """Let dynamo keep at least :data:`RECOMPILE_LIMIT` graphs per code object."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def compile_report() -> dict:
    """What torch.compile did in this process so far: graph breaks by reason (first line),
    graphs, frames compiled (first compiles and recompiles), and the classes fallen back."""
    from torch._dynamo.utils import counters

    reasons: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        line = reason.strip().splitlines()[0][:120]
        reasons[line] = reasons.get(line, 0) + count
    return {
        "graph_breaks": sum(reasons.values()),
        "break_reasons": reasons,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames_compiled": counters["frames"]["total"],
        "failures": list(COMPILE_FAILURES),
    }
