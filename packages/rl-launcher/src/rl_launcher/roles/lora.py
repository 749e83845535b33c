"""A run's LoRA adapters: the trainer's spec (``model.lora_*``) and how they reach the engines.

With ``model.lora_sync: adapter`` the engines keep the base weights and get the adapters
alone each sync: training writes them as a PEFT directory ``<sync dir>/lora/policy_v<N>``
(rl-fsdp's ``export_lora_adapter``, atomic), rank 0 has every engine load it under that
new name (SGLang's ``/load_lora_adapter``; real SGLang is started with ``--enable-lora``,
``--max-lora-rank`` and ``--lora-target-modules``, the embedded engine likewise), sets the
engines' weight version and unloads adapters older than the previous one; the driver then
sends every request with ``lora_path: policy_v<N>``. Version 0 (before any sync) is the
base itself, as LoRA starts with B = 0. ``merged`` sends the merged weights through the
usual transports instead (every base weight each sync).
"""

import asyncio
import re
import shutil
import time
from pathlib import Path

ADAPTER_PREFIX = "policy_v"
KEEP_LOADED = 2  # this version's adapter and the one before (requests already sent name it)


def lora_spec(config):
    """``LoRASpec`` of ``config.model``, None when ``lora_rank`` is 0 (rl-fsdp imported
    only when adapters are asked for)."""
    model = config.model
    if not model.lora_rank:
        return None
    from rl_fsdp.lora import LoRASpec

    return LoRASpec(
        rank=model.lora_rank,
        alpha=model.lora_alpha,
        dropout=model.lora_dropout,
        targets=tuple(model.lora_targets),
    )


def syncs_adapter(config) -> bool:
    """True when the engines get the adapters alone (``model.lora_sync: adapter``)."""
    return bool(config.model.lora_rank) and config.model.lora_sync == "adapter"


def adapter_name(version) -> str:
    return f"{ADAPTER_PREFIX}{version}"


# ---- engine start-up ----------------------------------------------------------------
def sglang_lora_args(config) -> dict:
    """``sglang.launch_server`` options that let it load the run's adapters at run time."""
    if not syncs_adapter(config):
        return {}
    model = config.model
    return {
        "enable_lora": True,
        "max_lora_rank": model.lora_rank,
        "lora_target_modules": list(model.lora_targets),
    }


def embedded_lora_args(config) -> list[str]:
    """The embedded engine's command-line options of the same meaning."""
    if not syncs_adapter(config):
        return []
    model = config.model
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(model.lora_rank),
        "--lora-target-modules",
        *model.lora_targets,
    ]


# ---- a training rank's side of a sync -------------------------------------------------
class AdapterSync:
    """Writes the adapters (all ranks: a collective) and has every engine load them
    (rank 0). Its event loop and engine clients live as long as the rank."""

    def __init__(self, rank: int):
        self.rank, self._loop, self._clients = rank, None, {}

    def sync(self, backend, urls: list[str], version: str, how: dict) -> dict[str, float]:
        """The adapters of ``backend`` into every engine as :func:`adapter_name` of
        ``version``; the bytes written (``sync/bytes``) and times, as a full sync reports."""
        start = time.perf_counter()
        root = Path(how["path"]) / "lora"
        name = adapter_name(version)
        sent = backend.export_lora_adapter(root / name)
        exported = time.perf_counter() - start
        if self.rank == 0:
            self._run(self._load(urls, name, root / name, version))
            remove_old_dirs(root, keep=KEEP_LOADED)
        return {
            "sync/bytes": float(sent),
            "time/sync_call": time.perf_counter() - start,
            "time/sync_export": exported,
        }

    async def _load(self, urls, name: str, path: Path, version: str) -> None:
        from rl_sglang.client import EngineClient

        clients = [self._clients.setdefault(url, EngineClient(url)) for url in urls]
        await asyncio.gather(*(load_version(c, name, path, version) for c in clients))

    def _run(self, work):
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(work)


async def load_version(client, name: str, path: Path, version: str) -> None:
    """Load adapter ``name`` from ``path`` into one engine, report ``version``, and unload
    the run's adapters older than the last :data:`KEEP_LOADED`."""
    answer = await client.load_lora_adapter(name, str(path))
    await client.update_weight_version(version)
    for old in stale_adapters(answer.get("loaded_adapters") or {}, keep=KEEP_LOADED):
        await client.unload_lora_adapter(old)


async def restore_adapter(client, root, version: int) -> None:
    """A restarted engine, holding the base it started with, gets the adapter of
    ``version`` from the sync directory ``root`` under the name the other engines serve it
    by, and reports ``version``; version 0 (no sync yet) is the base itself."""
    if version:
        name = adapter_name(version)
        await load_version(client, name, Path(root) / "lora" / name, str(version))


def stale_adapters(loaded, *, keep: int) -> list[str]:
    """The run's adapter names in ``loaded`` but the ``keep`` newest versions."""
    versions = sorted(v for v in map(_version_of, loaded) if v is not None)
    return [adapter_name(v) for v in versions[: max(0, len(versions) - keep)]]


def _version_of(name: str) -> int | None:
    match = re.fullmatch(rf"{ADAPTER_PREFIX}(\d+)", name)
    return int(match[1]) if match else None


def remove_old_dirs(root: Path, *, keep: int) -> None:
    """Adapter directories of versions no engine holds any more."""
    found = {v: d for d in root.iterdir() if (v := _version_of(d.name)) is not None}
    for version in sorted(found)[: max(0, len(found) - keep)]:
        shutil.rmtree(found[version], ignore_errors=True)


# ---- the driver's side -------------------------------------------------------------------
def serve_adapter(run, version: int) -> None:
    """After a sync: every request of the rollout (and eval) names this version's adapter."""
    if run.sync_options.get("lora_sync") != "adapter":
        return
    name = adapter_name(version)
    pool = run.rollout.engines
    if not pool.urls:  # a replay: no engine to ask
        return
    for url in {pool.url, *pool.urls}:
        pool.client(url).lora_path = name
    run.extras["lora_adapter"] = name
