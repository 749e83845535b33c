"""The same tiny GRPO job in TRL's ``GRPOTrainer`` and in ``rl-train`` on CPU (issue 21).

    uv run --with 'trl==1.16.*' python bench/vs_trl.py [--seeds 1,2,3] [--steps 600] \
        [--work /tmp/vs_trl] [--json runs/vs_trl.json]

TRL is not in the workspace: ``uv run --with`` lays an ephemeral environment holding it
over the workspace's, and this script runs there. The rl-train side is the workspace's
own ``.venv/bin/rl-train`` (the command a user runs); the TRL side is this file again
(``--trl-child``) under the same interpreter. Each run is a subprocess, timed from spawn
to exit; the runs alternate (rl-train, TRL, rl-train, TRL, ...) one seed at a time so that
a load spike from other jobs on the machine hits both sides alike.

The job: a tiny Qwen2-shaped model (the quickstart's shape and character tokenizer) is
built with fixed random weights and warmed by supervised fine-tuning, here in this
process, on a fixed half of the additions of two operands 0..9 (``"3+4="`` -> ``"7"``,
``"9+8="`` -> ``"17"``); both sides then start from that one HF directory and train GRPO
on all 100 additions: 8 prompts x 8 samples per step, at most 3 new tokens (two digits
and EOS), temperature 1, the answer scored by rl-rewards' ``exact_match``, one AdamW
update per rollout (lr 1e-3 decaying linearly to 0, gradient norm clipped to 1), no KL,
no entropy bonus, advantages normalised within each group by its std, token-mean loss
(TRL's ``dapo``), and the old log-probs taken from the update's own forward (TRL with
``num_iterations`` 1; rl-train's ``algorithm.old_log_probs: train_step``). The reward runs
in the process that generates, without a time limit, on both sides (TRL has none;
rl-train's ``rollout.reward_timeout_s: null``: its reward worker processes cost about
15 ms a step on this job).

Threads: every process of both sides gets ``--threads`` OMP/MKL threads (1 by default:
on this shared 2-core machine a tiny model's step ran several times slower on two threads
than on one when other jobs were busy, on both sides); in rl-train's synchronous loop the
engine and the trainer take turns. Bytecode: this sandbox sets PYTHONDONTWRITEBYTECODE=1,
so every process would compile its imports at each start (tens of seconds for rl-train's
several processes); unless ``--cold``, both sides use a bytecode cache in the work folder,
warmed by one short untimed run each, as a machine that has run Python before has one.

Reported per run: wall time (spawn to exit) and the mean training reward of the last 50
steps; per seed the ratio rl-train / TRL; and their means. The last line printed is the
JSON of all of it.
"""

import argparse
import json
import os
import platform
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "quickstart" / "tokenizer"
MODEL_SHAPE = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 16,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
LAST = 50  # steps averaged for "equal learning"
# Output lines that mark the first step's start and each step's end (rl-train's "started
# in ...; step 1/N running" and progress lines; this file's TRL child prints the same).
FIRST_STEP = "; step 1/"
LAST_STEP = re.compile(r"^step \d+/\d+ ")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3", help="one rl-train and one TRL run each")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--work", default="/tmp/vs_trl", help="model, data and run folders")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP/MKL threads of every process of both sides"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="keep the environment's bytecode setting (PYTHONDONTWRITEBYTECODE=1 here: every "
        "process compiles its imports) instead of a bytecode cache warmed by one short run each",
    )
    parser.add_argument("--sides", default="ours,trl", help="which sides run, in this order")
    parser.add_argument(
        "--base-src",
        default=None,
        help="another checkout (e.g. a git worktree of an older commit): the side 'base' runs "
        "rl-train with its packages first on PYTHONPATH, for before/after in one invocation",
    )
    parser.add_argument(
        "--ours-src", default=None, help="the side 'ours' runs this checkout's packages instead"
    )
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the job's model and data


def additions() -> list[dict]:
    """All 100 prompts ``"a+b="`` with operands 0..9 and their labels."""
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10)]


def write_data(work: Path) -> Path:
    path = work / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in additions()))
    return path


def warm_model(work: Path, sft_steps: int = 50) -> Path:
    """The SFT-warmed starting model as an HF directory (tokenizer included); built once per
    ``work`` folder: seed 0 weights, full-batch AdamW at lr 3e-3 on a fixed half of the
    additions (answer digits and EOS in the loss)."""
    folder = work / "warm_model"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model(**MODEL_SHAPE)
    model = AutoModelForCausalLM.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    rows = random.Random(0).sample(additions(), 50)
    ids, labels = sft_tensors(tokenizer, rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(sft_steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"vs_trl: warm model SFT loss {loss.item():.3f} after {sft_steps} steps", flush=True)
    model.save_pretrained(folder)
    for name in os.listdir(TOKENIZER):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


def sft_tensors(tokenizer, rows: list[dict]):
    """``[B, T]`` input ids (prompt, answer, EOS, EOS-padded) and labels (-100 but on the
    answer and its EOS)."""
    import torch

    eos = tokenizer.eos_token_id
    width = max(len(tokenizer(r["prompt"] + r["label"]).input_ids) for r in rows) + 1
    ids, labels = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"]).input_ids
        answer = [*tokenizer(row["label"]).input_ids, eos]
        pad = width - len(prompt) - len(answer)
        ids.append(prompt + answer + [eos] * pad)
        labels.append([-100] * len(prompt) + answer + [-100] * pad)
    return torch.tensor(ids), torch.tensor(labels)


# ---------------------------------------------------------------- rl-train's side


def ours_config(work: Path, model: Path, data: Path, seed: int, steps: int, side: str) -> Path:
    """rl-train's config for the job (YAML is a superset of JSON)."""
    run_dir = work / f"{side}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = {
        "seed": seed,
        "num_steps": steps,
        "model": {"path": str(model)},
        "optimizer": {"lr": 1e-3, "schedule": "linear", "min_lr_ratio": 0.0, "grad_clip": 1.0},
        "algorithm": {
            "advantage_estimator": "grpo",
            "num_minibatches": 1,
            "old_log_probs": "train_step",
            "loss_agg_mode": "token-mean",
        },
        "rollout": {
            "batch_size": 8,
            "group_size": 8,
            "max_response_tokens": 3,
            "temperature": 1.0,
            "reward": "exact_match",
            "reward_timeout_s": None,
        },
        "data": {
            "train": [{"path": str(data)}],
            "apply_chat_template": False,
            "max_prompt_tokens": 8,
        },
        "logging": {"run_dir": str(run_dir)},
    }
    path = work / f"{side}_seed{seed}.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


def ours_command(config: Path) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "rl-train"), "--config", str(config)]


def ours_rewards(work: Path, seed: int, side: str) -> list[float]:
    lines = (work / f"{side}_seed{seed}" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r["rollout/reward/mean"] for r in records if "rollout/reward/mean" in r]


# ---------------------------------------------------------------- TRL's side


def trl_command(work: Path, model: Path, data: Path, seed: int, steps: int) -> list[str]:
    out = work / f"trl_seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    return [
        sys.executable,
        __file__,
        "--trl-child",
        "--seed",
        str(seed),
        "--steps",
        str(steps),
        "--work",
        str(work),
        "--out",
        str(out),
    ]


def exact_match(completions, label, **_) -> list[float]:
    """rl-rewards' ``exact_match`` on each completion's text against the row's label."""
    from rl_rewards import get_reward

    score = get_reward("exact_match")
    return [float(score(text, gold)) for text, gold in zip(completions, label, strict=True)]


def trl_child(args: argparse.Namespace) -> int:
    """One TRL run of the job; writes ``<out>/rewards.json`` (mean reward per step)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    work, out = Path(args.work), Path(args.out)
    model_dir = work / "warm_model"
    config = GRPOConfig(
        output_dir=str(out),
        max_steps=args.steps,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=64,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=3,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    rewards: list[float] = []

    class Rewards(TrainerCallback):
        """Each step's mean reward, and the lines that time the phases (see ``timed``)."""

        def on_train_begin(self, *_, **__):
            print(f"vs_trl: trl started; step 1/{args.steps} running", flush=True)

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                print(
                    f"step {state.global_step}/{args.steps} reward {logs['reward']:.3f}", flush=True
                )

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[exact_match],
        args=config,
        train_dataset=Dataset.from_list(additions()),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[Rewards()],
    )
    trainer.train()
    out.mkdir(parents=True, exist_ok=True)
    (out / "rewards.json").write_text(json.dumps(rewards))
    return 0


def trl_rewards(work: Path, seed: int) -> list[float]:
    return json.loads((work / f"trl_seed{seed}" / "rewards.json").read_text())


# ---------------------------------------------------------------- the comparison


def side_env(threads: int, checkout: str | None = None) -> dict[str, str]:
    """The environment of a run: ``threads`` OMP/MKL threads per process and, given a
    ``checkout``, its packages instead of the workspace's (their ``src`` folders before
    the editable installs on the path; Ray's workers inherit it)."""
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if checkout is None:
        return env
    sources = sorted(str(p) for p in (Path(checkout) / "packages").glob("*/src"))
    return env | {"PYTHONPATH": os.pathsep.join(sources)}


def timed(command: list[str], log: Path, env: dict[str, str]) -> dict[str, float]:
    """Seconds from spawn to exit of ``command`` (``wall_s``), and its phases: to the
    first step's start (``startup_s``: the line with FIRST_STEP) and from the last step's
    end to exit (``tail_s``: the last line with LAST_STEP). Output goes to ``log``, each
    line stamped with its second since spawn; a failed run raises."""
    start, marks, before = time.perf_counter(), {}, children_cpu_s()
    with log.open("w") as out:
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env, text=True
        )
        for line in child.stdout:
            now = time.perf_counter() - start
            out.write(f"[{now:7.2f}] {line}")
            if FIRST_STEP in line and "startup" not in marks:
                marks["startup"] = now
            if LAST_STEP.search(line):
                marks["last_step"] = now
        code = child.wait()
    seconds = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{command[0]} exited {code}; see {log}")
    return {
        "wall_s": seconds,
        "startup_s": marks.get("startup", float("nan")),
        "tail_s": seconds - marks.get("last_step", float("nan")),
        "cpu_s": children_cpu_s() - before,
    }


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished descendants that were waited
    for: all of TRL's; for rl-train a lower bound (Ray workers that their raylet did not
    reap before it was stopped are not counted)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def side_run(side: str, args: argparse.Namespace, seed: int, steps: int) -> dict[str, float]:
    """Run ``side`` (ours, base or trl) once for ``steps`` steps; its times (``timed``)."""
    work = Path(args.work)
    env = side_env(args.threads, {"base": args.base_src, "ours": args.ours_src}.get(side))
    if not args.cold:  # bytecode cached in the bench's own folder, as a used machine has it
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    model, data = work / "warm_model", work / "train.jsonl"
    if side == "trl":
        command = trl_command(work, model, data, seed, steps)
    else:
        command = ours_command(ours_config(work, model, data, seed, steps, side))
    return timed(command, work / f"{side}_seed{seed}.log", env)


def one_run(side: str, args: argparse.Namespace, seed: int) -> dict:
    """Run ``side`` once; its times and first and last 50 steps' mean reward."""
    work, steps = Path(args.work), args.steps
    load = os.getloadavg()[0]
    times = side_run(side, args, seed, steps)
    rewards = trl_rewards(work, seed) if side == "trl" else ours_rewards(work, seed, side)
    assert len(rewards) == steps, f"{side} seed {seed}: {len(rewards)} steps logged"
    last = statistics.fmean(rewards[-LAST:])
    first = statistics.fmean(rewards[:LAST])
    print(
        f"vs_trl: {side} seed {seed}: {times['wall_s']:.1f}s (start-up {times['startup_s']:.1f}"
        f", after the steps {times['tail_s']:.1f}; CPU {times['cpu_s']:.1f}s), "
        f"reward first {LAST} {first:.3f}, "
        f"last {LAST} {last:.3f} (load {load:.1f})",
        flush=True,
    )
    return times | {"reward_last50": last, "reward_first50": first, "load_1min": load}


def summarize(runs: dict) -> dict:
    """Means over seeds per side, and each rl-train side against TRL: the per-seed wall
    time ratios and last-50 reward gaps, and the ratio of the mean wall times."""
    out = {}
    for side, by_seed in runs.items():
        for key in ("wall_s", "startup_s", "tail_s", "cpu_s", "reward_last50"):
            out[f"{side}_{key}_mean"] = statistics.fmean(r[key] for r in by_seed.values())
    for side in set(runs) - {"trl"}:
        seeds = sorted(set(runs[side]) & set(runs.get("trl", {})))
        if not seeds:
            continue
        ours, trl = runs[side], runs["trl"]
        out[f"{side}_ratio_per_seed"] = [ours[s]["wall_s"] / trl[s]["wall_s"] for s in seeds]
        out[f"{side}_reward_gap_per_seed"] = [
            ours[s]["reward_last50"] - trl[s]["reward_last50"] for s in seeds
        ]
        out[f"{side}_ratio_of_means"] = out[f"{side}_wall_s_mean"] / out["trl_wall_s_mean"]
        out[f"{side}_reward_gap_of_means"] = (
            out[f"{side}_reward_last50_mean"] - out["trl_reward_last50_mean"]
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_child:
        return trl_child(args)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    warm_model(work), write_data(work)
    sides, runs = args.sides.split(","), {}
    if args.base_src and "base" not in sides:
        sides.insert(0, "base")
    if not args.cold:  # one short untimed run each: their imports' bytecode is then cached
        for side in sides:
            side_run(side, args, seed=0, steps=2)
    for seed in (int(s) for s in args.seeds.split(",")):
        for side in sides:
            runs.setdefault(side, {})[seed] = one_run(side, args, seed)
    result = {
        "runs": runs,
        "summary": summarize(runs),
        "steps": args.steps,
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        "command": "uv run --with 'trl==1.16.*' python bench/vs_trl.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
