"""The embedded engine: an HF causal LM, its tokenizer and the continuous-batching
scheduler, behind methods that take and return SGLang-shaped dicts."""

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from rl_core.fp8 import dequantize_named
from rl_sglang.engine import weights
from rl_sglang.engine.lora import ALL_TARGETS, LoRAManager, read_peft_adapter
from rl_sglang.engine.request import Request
from rl_sglang.engine.routes import RouteRecorder
from rl_sglang.engine.runner import ModelRunner
from rl_sglang.engine.scheduler import Scheduler
from rl_sglang.engine.stopping import StopChecker
from rl_sglang.protocol import SamplingParams, normalize_prompts

logger = logging.getLogger(__name__)


def load_model(model_path: str, *, device: str = "cpu", dtype: str = "auto", seed: int = 0):
    """``(model, tokenizer)`` from an HF directory, or random weights from a ``config.json``
    file (the tokenizer is then the byte-level one of :mod:`rl_sglang.tiny`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rl_sglang.fp8_checkpoint import is_fp8_checkpoint, load_fp8_model

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    path = Path(model_path)
    if path.is_file():  # a bare config: random weights, for benchmarks
        from rl_sglang.tiny import byte_tokenizer

        config = AutoConfig.from_pretrained(path)
        torch.manual_seed(seed)
        dtype_for_init = torch.float32 if torch_dtype == "auto" else torch_dtype
        model = AutoModelForCausalLM.from_config(config, dtype=dtype_for_init)
        tokenizer = byte_tokenizer()
    elif is_fp8_checkpoint(path):  # served dequantised: see rl_sglang.fp8_checkpoint
        model = load_fp8_model(path, torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    return model.to(device).eval(), tokenizer


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))


DEFAULT_MULTI_STEP = 8
SCORE_BATCH = 32  # prompts per forward when scoring prompt log-probs


class Engine:
    """Generation and control operations of one embedded engine (one model, one device).

    ``compile`` (static runner only): ``torch.compile`` the decode layer before the CUDA
    graphs are captured; ``None`` turns it on with CUDA (it costs start-up time once).
    ``multi_step`` (static runner only): greedy decode rounds of that many steps when no
    row can finish by length and nothing waits within them (outputs are unchanged);
    ``sampled_multi_step`` (static runner): such rounds for sampled batches too, each draw
    inside the round (a seeded row's tokens are unchanged; off by default until measured
    on a GPU).
    ``enable_lora``: serve LoRA adapters per request (:mod:`rl_sglang.engine.lora`) on the
    Linears named by ``lora_targets``, of rank up to ``max_lora_rank`` (None: any); the
    adapters' hooks run in the model's own modules, so the runner is the dynamic one.
    ``enable_return_routed_experts``: every response carries ``routed_experts``
    (:mod:`rl_sglang.engine.routes`; dynamic runner), asked for or not.
    ``stable_memory`` (static runner on CUDA): weights and KV cache at addresses
    that survive a memory release, so a resume maps memory back instead of capturing the
    graphs again (:mod:`rl_sglang.engine.stable_memory`); ``None``: on with CUDA.
    ``mem_fraction`` (static runner on CUDA): the share of the device's memory the engine
    may hold (weights, KV slots, graphs), as SGLang's ``--mem-fraction-static``;
    ``max_batch_size`` is lowered to the slots that fit. ``None``: no bound.
    ``decode_attention`` (static runner): ``"triton"``, ``"sdpa"`` or ``"auto"`` (Triton
    on CUDA), see :class:`~rl_sglang.engine.static.StaticRunner`."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_path="",
        max_batch_size=64,
        runner="auto",
        max_context=None,
        compile=None,
        multi_step=DEFAULT_MULTI_STEP,
        sampled_multi_step=False,
        enable_lora=False,
        max_lora_rank=None,
        lora_targets=(ALL_TARGETS,),
        enable_return_routed_experts=False,
        stable_memory=None,
        mem_fraction=None,
        decode_attention="auto",
    ):
        self.model, self.tokenizer, self.model_path = model, tokenizer, model_path
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype  # FP8 updates are dequantised to it
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else model.config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.max_context = min(
            max_context or 1 << 30, getattr(model.config, "max_position_embeddings", 1 << 30)
        )
        if enable_lora and runner == "static":
            raise ValueError("--enable-lora runs the dynamic runner; drop --runner static")
        if runner == "auto" and (enable_lora or enable_return_routed_experts):
            runner = "dynamic"  # adapters and route recording hook the model's own modules
        self.runner_kind = choose_runner(runner, model, self.max_context, max_batch_size)
        self.compile = self.device.type == "cuda" if compile is None else compile  # None: auto
        if int(multi_step) < 1:
            raise ValueError(
                f"multi_step must be >= 1 (1 = one decode step per round), got {multi_step}"
            )
        self.multi_step = int(multi_step)
        self.sampled_multi_step = bool(sampled_multi_step)
        self.stable_memory = self.device.type == "cuda" if stable_memory is None else stable_memory
        self.decode_attention = decode_attention
        if mem_fraction is not None and self.runner_kind == "static":
            max_batch_size = self._slots_within(max_batch_size, mem_fraction)
        routes = RouteRecorder(model if enable_return_routed_experts else None)
        if routes.enabled and self.runner_kind == "static":
            raise ValueError("--enable-return-routed-experts needs the dynamic runner")
        self.scheduler = Scheduler(
            self._make_runner(max_batch_size),
            StopChecker(tokenizer, eos_ids, self.max_context),
            max_batch_size=max_batch_size,
        )
        self.lora = None
        if enable_lora:
            self.lora = LoRAManager(model, max_rank=max_lora_rank, targets=lora_targets)
            self.scheduler.lora = self.lora
        if routes.enabled:
            self.scheduler.routes = routes
        self.weight_receivers: dict[str, weights.WeightReceiver] = {}
        self.memory_released = False
        self.weights_dropped = False  # released without their contents, not updated since
        self._parked_runner = None  # the runner while memory is released
        self._weight_targets: dict | None = None  # state_dict() for updates, reset on moves

    def _slots_within(self, max_batch_size: int, mem_fraction: float) -> int:
        """``max_batch_size`` lowered to the slots whose caches fit in ``mem_fraction``
        of the device beside the weights (CUDA; elsewhere unchanged)."""
        if not 0 < mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
        if self.device.type != "cuda":
            return max_batch_size
        from rl_sglang.engine.static import slots_that_fit

        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(mem_fraction * total) - torch.cuda.memory_allocated(self.device)
        fit = slots_that_fit(self.model, self.max_context, budget)
        if fit < 1:
            raise ValueError(
                f"no KV slot of {self.max_context} positions fits in mem_fraction "
                f"{mem_fraction} of this device beside the weights; raise --mem-fraction "
                "or lower --max-context"
            )
        if fit < max_batch_size:
            logger.info(
                "max batch size %d -> %d: the slots' caches for context %d fit in "
                "mem_fraction %.2f of the device",
                max_batch_size,
                fit,
                self.max_context,
                mem_fraction,
            )
        return min(max_batch_size, fit)

    def _make_runner(self, max_batch_size: int):
        if self.runner_kind == "static":
            from rl_sglang.engine.static import StaticRunner

            if self.max_context >= 1 << 20:
                raise ValueError("the static runner needs a bounded context: pass max_context")
            return StaticRunner(
                self.model,
                max_slots=max_batch_size,
                max_len=self.max_context,
                compile=self.compile,
                multi_step=self.multi_step,
                sampled_multi_step=self.sampled_multi_step,
                stable_memory=self.stable_memory,
                attention=self.decode_attention,
            )
        pad = self.model.config.pad_token_id
        return ModelRunner(self.model, pad_token_id=pad if pad is not None else 0)

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ---- generation ---------------------------------------------------------------------
    def make_requests(self, body: dict[str, Any]) -> tuple[list[list[Request]], bool]:
        """Requests of a /generate body, grouped per prompt (n samples each), and whether
        the body was a batch."""
        if self.weights_dropped:
            raise ValueError(
                "the engine dropped its weights at a memory release naming 'weights'; update "
                "them (/update_weights_from_tensor, _from_distributed or _from_disk) first"
            )
        prompts, is_batch = normalize_prompts(body)
        params_list = body.get("sampling_params") or {}
        if not isinstance(params_list, list):
            params_list = [params_list] * len(prompts)
        rids = body.get("rid") or [uuid.uuid4().hex for _ in prompts]
        rids = rids if isinstance(rids, list) else [rids]
        if len(rids) != len(prompts) or len(params_list) != len(prompts):
            raise ValueError("rid and sampling_params lists must have one entry per prompt")
        adapters = self._adapters(body.get("lora_path"), len(prompts))
        groups = [
            self._expand(prompt, SamplingParams.from_dict(params), rid, body, adapter)
            for prompt, params, rid, adapter in zip(
                prompts, params_list, rids, adapters, strict=True
            )
        ]
        return groups, is_batch

    def _adapters(self, lora_path, num_prompts: int) -> list:
        """The adapter of each prompt: ``lora_path`` is one adapter name for all, a list of
        one name (or None: the base) per prompt, or None."""
        names = lora_path if isinstance(lora_path, list) else [lora_path] * num_prompts
        if len(names) != num_prompts:
            raise ValueError(f"lora_path has {len(names)} entries for {num_prompts} prompts")
        if self.lora is None:
            if any(name is not None for name in names):
                raise ValueError("lora_path needs an engine started with --enable-lora")
            return names
        return [self.lora.resolve(name) for name in names]

    # ---- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter) ----------------
    async def load_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """Read the PEFT directory ``lora_path`` and serve it as ``lora_name``."""
        lora = self._lora_manager()
        name, path = _text_field(body, "lora_name"), _text_field(body, "lora_path")
        dtype = next(self.model.parameters()).dtype
        adapter = await asyncio.to_thread(read_peft_adapter, name, path, self.device, dtype)
        await self.on_scheduler(lambda: lora.load(adapter))
        return self.lora_answer()

    async def unload_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        lora = self._lora_manager()
        name = _text_field(body, "lora_name")
        await self.on_scheduler(lambda: lora.unload(name))
        return self.lora_answer()

    def lora_answer(self) -> dict[str, Any]:
        """SGLang's LoRAUpdateOutput."""
        loaded = self.lora.loaded() if self.lora is not None else {}
        return {"success": True, "error_message": "", "loaded_adapters": loaded}

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with --enable-lora")
        return self.lora

    def _expand(
        self, prompt, params: SamplingParams, rid: str, body: dict, adapter=None
    ) -> list[Request]:
        ids = self._encode(prompt) if isinstance(prompt, str) else prompt
        routes = self.scheduler.routes.enabled
        if body.get("return_routed_experts") and not routes:
            raise ValueError(
                "return_routed_experts needs an engine started with "
                "--enable-return-routed-experts (an MoE model)"
            )
        # started for routes, the engine returns them for every request: sglang-router
        # (0.3.2) drops return_routed_experts from the bodies it forwards
        if not ids or len(ids) >= self.max_context:
            raise ValueError(f"prompts need 1 to {self.max_context - 1} tokens, got {len(ids)}")
        requests = []
        for index in range(params.n):
            sample_params = SamplingParams(**{**vars(params), "n": 1})
            if params.sampling_seed is not None:
                sample_params.sampling_seed = params.sampling_seed + index
            sample_rid = rid if params.n == 1 else f"{rid}-{index}"
            requests.append(
                Request(
                    rid=sample_rid,
                    parent_rid=rid,
                    prompt_ids=list(ids),
                    params=sample_params,
                    return_logprob=bool(body.get("return_logprob", False)),
                    logprob_start_len=_start_len(body.get("logprob_start_len"), len(ids)),
                    adapter=adapter,
                    return_routed_experts=routes,
                )
            )
        return requests

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer; send input_ids instead of text")
        return self.tokenizer.encode(text)

    async def run(self, requests: list[Request]) -> list[dict[str, Any]]:
        """Submit requests and wait for all of them; their /generate responses in order."""
        loop = asyncio.get_running_loop()
        scored = [r for r in requests if r.return_logprob and r.logprob_start_len is not None]
        if scored:  # on the scheduler thread: no weight update lands mid-forward
            await self.on_scheduler(lambda: self.score(scored))
        futures = []
        for request in requests:
            future = loop.create_future()
            request.on_done = _resolver(loop, future)
            futures.append(future)
        self.scheduler.submit(*requests)
        return [request.response() for request in await asyncio.gather(*futures)]

    @torch.inference_mode()
    def score(self, requests: list[Request]) -> None:
        """Teacher-forced log-probs of each request's ``prompt_ids[logprob_start_len:]``,
        each given the ids before it, at temperature 1 (SGLang's ``input_token_logprobs``):
        the first prompt id has no context, so its entry is None. Right-padded forwards of
        up to ``SCORE_BATCH`` prompts. A teacher scores a student's samples this way
        (``max_new_tokens: 0``)."""
        for start in range(0, len(requests), SCORE_BATCH):
            chunk = requests[start : start + SCORE_BATCH]
            width = max(len(r.prompt_ids) for r in chunk)
            ids_BT = torch.zeros(len(chunk), width, dtype=torch.long)
            mask_BT = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, request in enumerate(chunk):
                ids_BT[row, : len(request.prompt_ids)] = torch.tensor(request.prompt_ids)
                mask_BT[row, : len(request.prompt_ids)] = 1
            ids_BT, mask_BT = ids_BT.to(self.device), mask_BT.to(self.device)
            self.scheduler.use_adapters(chunk)
            logits_BTV = self.model(input_ids=ids_BT, attention_mask=mask_BT).logits[:, :-1]
            logprobs_BT = torch.log_softmax(logits_BTV.float(), dim=-1)
            logprobs_BT = logprobs_BT.gather(-1, ids_BT[:, 1:, None]).squeeze(-1).tolist()
            for row, request in enumerate(chunk):
                values = [None, *logprobs_BT[row][: len(request.prompt_ids) - 1]]
                request.input_logprobs = values[request.logprob_start_len :]

    # ---- control ------------------------------------------------------------------------
    async def on_scheduler(self, fn):
        """Run ``fn`` on the scheduler thread between decode steps and await its result."""
        return await asyncio.wrap_future(self.scheduler.call(fn))

    def bump_version(self, requested: str | None) -> str:
        current = self.scheduler.weight_version
        if requested is not None:
            new = str(requested)
        else:
            new = str(int(current) + 1) if current.isdigit() else f"{current}+1"
        self.scheduler.weight_version = new
        return new

    def apply_update(self, named, body: dict[str, Any]) -> dict[str, Any]:
        """Abort if asked, copy the tensors, bump the version (runs on the scheduler thread,
        so no decode step sees half-updated weights)."""
        self.check_weights_resident()
        self.weights_dropped = False  # a sync after a release that dropped them refills all
        num_in_flight = self.scheduler.num_running
        if body.get("abort_all_requests"):
            self.scheduler.abort_now(None, message="aborted for a weight update")
        # the static runner's fused q/k/v and gate/up hold the projections: no refresh
        count = weights.run_copy(self._copy_plan(named))
        version = self.bump_version(body.get("weight_version"))
        # flush_cache: this engine keeps no prefix cache, so there is nothing to drop
        return {
            "success": True,
            "message": f"updated {count} tensors; weight_version {version}",
            "num_paused_requests": num_in_flight,
            "weight_version": version,
        }

    def _copy_plan(self, named) -> weights.CopyPlan:
        """Where each tensor goes. A bucket held open (a KeptBucket: the sender's kept
        buffer, same layout) keeps its plan while the parameters keep their storage, so a
        steady-state update is one fused copy, not a lookup and check per tensor."""
        if self._weight_targets is None:  # the parameters' current storage
            self._weight_targets = self.model.state_dict()
        plan = getattr(named, "plan", None)
        if plan is not None and plan.targets is self._weight_targets:
            return plan
        converted = dequantize_named(named, self.dtype)  # FP8 weights + scales: see README
        plan = weights.copy_plan(self.model, converted, self._weight_targets)
        unconverted = len(converted) == len(named) and all(
            a is b for (_, a), (_, b) in zip(converted, named, strict=True)
        )
        if isinstance(named, weights.KeptBucket) and plan.reusable and unconverted:
            named.plan = plan
        return plan

    def update_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's ``/update_weight_version``: the version the engine reports from now on
        (after loading an adapter, whose load does not change it), aborting if asked."""
        version = _text_field(body, "new_version")
        if body.get("abort_all_requests"):
            self.scheduler.abort_now(None, message="aborted for a weight version update")
        self.scheduler.weight_version = version
        return {"success": True, "message": f"weight_version {version}", "new_version": version}

    def release_memory(self, *, keep_weights: bool = True) -> None:
        """Retract running requests, then on GPU free the KV cache (the runner) and move the
        weights to host memory; on CPU nothing is freed. A runner in stable memory unmaps
        it instead: the parameters keep their addresses (and the weight copy plans), and
        with ``keep_weights=False`` their contents are dropped, not copied to the host: they
        come back zeroed, and generation is refused until a weight update (SGLang's
        behaviour for released weights without a CPU backup)."""
        self.scheduler.pause_now("retract")
        if self.device.type == "cuda" and self.scheduler.runner is not None:
            start = time.perf_counter()
            self._parked_runner, self.scheduler.runner = self.scheduler.runner, None
            stay = self._weights_stay()
            drop = not keep_weights and stay
            if hasattr(self._parked_runner, "release"):  # static: its caches and graphs
                self._parked_runner.release(keep_weights=not drop)
            if not stay:
                self._weight_targets = None  # the parameters get new storage
                self.model.to("cpu")
            torch.cuda.empty_cache()
            self.weights_dropped = self.weights_dropped or drop
            self._log_memory("released", start)
        self.memory_released = True

    def resume_memory(self) -> None:
        """Weights back on the device and the runner's caches and CUDA graphs rebuilt
        against the new parameter storage (a static runner keeps its compiled step, so
        this captures but does not compile; in stable memory it maps the memory back and
        keeps its graphs), generation continued."""
        start, stay = time.perf_counter(), self._weights_stay()
        if not stay:
            self._weight_targets = None  # the parameters may have new storage
        if self.scheduler.runner is None:
            if not stay:
                self.model.to(self.device)
            runner = self._parked_runner
            try:
                if hasattr(runner, "resume"):
                    runner.resume()
                else:
                    runner = self._make_runner(self.scheduler.max_batch_size)
            except (RuntimeError, torch.OutOfMemoryError) as error:  # the runner stays parked
                raise RuntimeError(
                    f"resuming the engine's memory failed ({error}); it stays released: free "
                    "device memory and call /resume_memory_occupation again"
                ) from error
            self._parked_runner = None
            self.scheduler.runner = runner
            self._log_memory("resumed", start)
        self.memory_released = False
        self.scheduler.resume_now()

    def _log_memory(self, what: str, start: float) -> None:
        torch.cuda.synchronize(self.device)
        stable = self._weights_stay()
        logger.info(
            "memory %s in %.1f ms (%s; %.2f GiB of device memory free)",
            what,
            (time.perf_counter() - start) * 1e3,
            (
                "stable: weights dropped, the next update refills them"
                if self.weights_dropped
                else "stable: mapped at the same addresses"
            )
            if stable
            else "weights moved to the host and back",
            torch.cuda.mem_get_info(self.device)[0] / 2**30,
        )

    def _weights_stay(self) -> bool:
        """The parameters live in the runner's stable memory (unmapped while released)."""
        runner = self.scheduler.runner or self._parked_runner
        return getattr(runner, "stable", None) is not None

    def check_weights_resident(self) -> None:
        """Raise when the parameters are unmapped: touching them would fault the device."""
        if self.memory_released and self._weights_stay():
            raise ValueError(
                "the engine's memory is released; call /resume_memory_occupation before "
                "updating or reading weights"
            )

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path if self.tokenizer is not None else None,
            "is_generation": True,
            "weight_version": self.weight_version,
        }

    def server_info(self) -> dict[str, Any]:
        from rl_sglang import __version__

        return {
            **self.model_info(),
            "engine": "rl-sglang-embedded",
            "version": __version__,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "tp_size": 1,
            "dp_size": 1,
            "max_running_requests": self.scheduler.max_batch_size,
            "runner": self.runner_kind,
            "compiled": bool(getattr(self.scheduler.runner, "compiled", False)),
            "context_length": self.max_context,
            "paused": self.scheduler.paused,
            "memory_released": self.memory_released,
            "enable_lora": self.lora is not None,
            "enable_return_routed_experts": self.scheduler.routes.enabled,
            "max_lora_rank": self.lora.max_rank if self.lora is not None else None,
            "lora_target_modules": list(self.lora.targets) if self.lora is not None else None,
            "loaded_adapters": self.lora.loaded() if self.lora is not None else {},
            "internal_states": [
                {
                    "num_running": self.scheduler.num_running,
                    "num_waiting": self.scheduler.num_waiting,
                    "num_finished": self.scheduler.num_finished,
                }
            ],
        }


RUNNERS = ("auto", "dynamic", "static")


def _text_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None or value == "":
        raise ValueError(f"the request body needs {name!r}")
    return str(value)


def _start_len(value, num_ids: int) -> int | None:
    """``logprob_start_len`` of a body: None (absent, or SGLang's -1 = no prompt log-probs)
    or a position in the prompt."""
    if value is None or int(value) == -1:
        return None
    if not 0 <= int(value) < num_ids:
        raise ValueError(f"logprob_start_len must be -1 or in [0, {num_ids}), got {value}")
    return int(value)


# On CPU the static runner's fixed slot cache is worth it only while it stays small: it
# skips the HF forward's per-step mask and cache building (about a fifth of a tiny model's
# rollout CPU), but attends over the whole slot row and holds every slot from the start.
CPU_STATIC_CACHE_BYTES = 64 << 20


def choose_runner(
    kind: str, model, max_context: int | None = None, max_slots: int | None = None
) -> str:
    """``auto``: the static slot runner (CUDA graphs) on CUDA for Llama-family models, else
    the dynamic left-padded one; on CUDA the log says why a model cannot take the fast path
    (``max_context``: the longest context served, which a sliding window must cover). On CPU
    ``auto`` takes the static runner where it can and its slot cache (``max_slots`` rows of
    ``max_context`` tokens) fits :data:`CPU_STATIC_CACHE_BYTES`: small models and short
    contexts, whose decode steps the HF forward's bookkeeping dominates."""
    from rl_sglang.engine.static import static_unsupported_reason

    if kind not in RUNNERS:
        raise ValueError(f"unknown runner {kind!r}; choose one of {RUNNERS}")
    reason = static_unsupported_reason(model, max_context) if kind != "dynamic" else None
    if kind == "static" and reason is not None:
        raise ValueError(f"the static runner cannot take this model ({reason}); use dynamic")
    if kind == "auto":
        if not next(model.parameters()).is_cuda:
            if reason is not None:
                return "dynamic"
            cache_bytes = static_cache_bytes(model, max_context, max_slots)
            return "static" if cache_bytes <= CPU_STATIC_CACHE_BYTES else "dynamic"
        if reason is not None:
            logger.warning(
                "decoding without CUDA graphs (the dynamic runner, several times slower): %s",
                reason,
            )
            return "dynamic"
        return "static"
    return kind


def static_cache_bytes(model, max_context: int | None, max_slots: int | None) -> float:
    """Bytes of the static runner's key and value slots for ``max_slots`` rows of
    ``max_context`` tokens (infinite when either is unknown)."""
    if not max_context or not max_slots or max_context >= 1 << 20:
        return float("inf")
    from rl_sglang.engine.static import slot_cache_bytes

    return float(slot_cache_bytes(model, max_slots, max_context))


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    def resolve(request: Request) -> None:
        loop.call_soon_threadsafe(_set_result, future, request)

    return resolve


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
