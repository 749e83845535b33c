"""Evaluation on the configured eval sets through rl-sglang's eval rollout.

    evaluator = Evaluator(config, tokenizer)         # reads eval.datasets once
    metrics = evaluator.evaluate(url)                # eval/<dataset>/pass@<k>, reward stats
    evaluator.close()                                # its reward processes, if it owns them

Each prompt gets ``eval.samples_per_prompt`` samples at ``eval.temperature`` (and with
``eval.greedy`` one more at temperature 0, reported as ``eval/<dataset>/greedy@1``); a
sample is correct when its (scalar) reward is at least 1. During training it runs every
``eval.interval`` steps and at the last step (:func:`maybe_evaluate`), and with
``eval.at_start`` on the starting weights as step 0 (:func:`evaluate_at_start`);
``rl-eval`` runs it on a checkpoint or an HF directory. Rewards are scored as in the
rollout: under ``rollout.reward_timeout_s`` in reward worker processes (a call past the
limit has its process killed), failures handled per ``rollout.on_reward_error`` and counted
(``eval/reward_errors``, ``eval/reward_timeouts``); during training the evaluation shares
the rollout's worker processes.
"""

import asyncio
import time

from rl_launcher.data.source import load_dataset
from rl_launcher.roles.reward import load_reward


class Evaluator:
    def __init__(self, config, tokenizer, *, reward=None):
        """``reward``: a :class:`~rl_launcher.roles.reward.Reward` to score with (the
        rollout's, shared); by default one of the config's, with its own processes."""
        self.config, self.tokenizer = config, tokenizer
        self.lora_path = None  # the engines' LoRA adapter to evaluate (roles/lora.py)
        self.datasets = {}
        for spec in config.eval.datasets:
            dataset = load_dataset(
                spec,
                tokenizer=tokenizer,
                apply_chat_template=config.data.apply_chat_template,
                max_prompt_tokens=config.data.max_prompt_tokens,
                on_malformed=config.data.on_malformed,
                batch_rows=config.data.read_batch_rows,
            )
            if not dataset.prompts:
                raise ValueError(f"eval dataset {dataset.name!r} has no usable prompts")
            self.datasets[dataset.name] = seeded(config, dataset.name, dataset.prompts)
        self.reward_fn = reward or load_reward(
            config.rollout.reward,
            tokenizer,
            on_error=config.rollout.on_reward_error,
            timeout_s=config.rollout.reward_timeout_s,
            reward_key=config.algorithm.reward_key,
            options=config.rollout.reward_options,
        )

    def sampling_params(self) -> dict:
        evaluation, rollout = self.config.eval, self.config.rollout
        params = {
            "max_new_tokens": evaluation.max_response_tokens or rollout.max_response_tokens,
            "temperature": evaluation.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
        }
        return params | ({"stop": list(rollout.stop)} if rollout.stop else {})

    def evaluate(self, url: str) -> dict[str, float]:
        """Metrics of every eval set, generated through the server at ``url``."""
        start = time.perf_counter()
        metrics, _ = asyncio.run(self.run(url))
        if self.config.eval.greedy:
            metrics |= self.greedy(url)
        metrics["eval/num_prompts"] = float(sum(len(p) for p in self.datasets.values()))
        counts = self.reward_fn.take_counts()  # skipped failures: scored 0 here
        metrics |= {f"eval/{name}": float(number) for name, number in counts.items()}
        return metrics | {"time/eval": time.perf_counter() - start}

    def close(self) -> None:
        """Stop the reward's worker processes, if this evaluator started them."""
        self.reward_fn.close()

    def greedy(self, url: str) -> dict[str, float]:
        """``eval/<dataset>/greedy@1``: the share of prompts whose one greedy response is
        correct (its other metrics are left out: they would overwrite the sampled ones)."""
        params = self.sampling_params() | {"temperature": 0.0}
        metrics, _ = asyncio.run(self.run(url, samples=1, ks=[1], params=params))
        return {
            key.replace("/pass@1", "/greedy@1"): value
            for key, value in metrics.items()
            if key.endswith("/pass@1")
        }

    async def run(self, url: str, *, samples: int | None = None, ks=None, params=None):
        """``(metrics, groups per dataset)`` from a fresh client of ``url``; ``samples``,
        ``ks`` and ``params`` default to the eval config's."""
        from rl_sglang.client import EngineClient
        from rl_sglang.rollout.eval import eval_rollout
        from rl_sglang.rollout.generate import GenerateContext

        evaluation = self.config.eval
        per_prompt = samples or evaluation.samples_per_prompt
        total = per_prompt * max(len(p) for p in self.datasets.values())
        async with EngineClient(url, lora_path=self.lora_path) as client:
            ctx = GenerateContext(client=client, tokenizer=self.tokenizer)
            return await eval_rollout(
                ctx,
                self.datasets,
                self.reward_fn.rollout_fn,
                n_samples_per_prompt=per_prompt,
                ks=ks or evaluation.pass_k,
                sampling_params=params or self.sampling_params(),
                max_concurrency=max(1, min(256, total)),
                reward_key=self.config.algorithm.reward_key,
            )


def seeded(config, name: str, prompts: list) -> list:
    """With embedded engines, eval prompt ``i`` of ``name`` seeds its requests from the
    run's seed (:func:`rl_launcher.roles.rollout_manager.request_seed`): each eval samples
    with the same random numbers, so two evals differ by their weights alone."""
    from rl_launcher.roles.rollout_manager import request_seed

    if config.engine.kind == "embedded":
        for i, prompt in enumerate(prompts):
            prompt.metadata["sampling_seed"] = request_seed(config.seed, f"eval/{name}/{i}")
    return prompts


def is_eval_step(config, step: int) -> bool:
    interval = config.eval.interval
    return bool(interval) and (step % interval == 0 or step == config.num_steps)


def maybe_evaluate(run, step: int) -> dict[str, float]:
    """Eval metrics when ``step`` is an eval step of the run (else nothing)."""
    if not is_eval_step(run.config, step):
        return {}
    return evaluate_now(run)


def evaluate_at_start(run, first: int) -> None:
    """``eval.at_start``: the starting weights' eval metrics as a step-0 record and a
    console line, before step 1 (not on a resumed run, whose step 0 is long past)."""
    config = run.config
    if not (config.eval.at_start and config.eval.datasets) or first != 1:
        return
    metrics = evaluate_now(run)
    run.metrics_log.append(0, metrics)
    shown = ", ".join(
        f"{key.removeprefix('eval/')} {value:.3f}"
        for key, value in metrics.items()
        if "/pass@" in key or "/greedy@" in key
    )
    print(f"rl-train: eval before training ({metrics['time/eval']:.1f}s): {shown}", flush=True)


def evaluate_now(run) -> dict[str, float]:
    """Eval metrics of the engines' current weights."""
    evaluator = run.extras.get("evaluator")
    if evaluator is None:  # scored by the rollout's reward processes, under its time limit
        reward = run.rollout.reward_fn.sharing()
        evaluator = Evaluator(run.config, run.rollout.tokenizer, reward=reward)
        run.extras["evaluator"] = evaluator
    evaluator.lora_path = run.extras.get("lora_adapter")  # synced adapters: this version's
    return evaluator.evaluate(run.rollout.engines.url)
