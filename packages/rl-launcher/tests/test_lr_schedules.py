"""optimizer.schedule / warmup_steps / min_lr_ratio: rl-fsdp and rl-megatron, built from one
rl-train config, report the same ``train/lr`` at every step (one gloo rank, CPU)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_core.batch import TrainBatch
from rl_core.distributed import free_port
from rl_core.lr_schedule import lr_multiplier
from rl_core.packing import cu_seqlens_from_lengths
from rl_launcher.config.loader import load_config

pytestmark = pytest.mark.integration
NUM_STEPS = 6
SCHEDULES = ("constant", "linear", "cosine")


def rl_train_config(schedule: str):
    args = ["--optimizer.schedule", schedule, "--optimizer.warmup_steps", "2"]
    args += ["--optimizer.min_lr_ratio", "0.1", "--optimizer.lr", "1e-3"]
    return load_config([*args, "--num_steps", str(NUM_STEPS), "--backend.name", "megatron"])[0]


def tiny_model(directory) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))


def batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 5]
    return TrainBatch(
        tokens=torch.randint(0, 128, (sum(lengths),), generator=gen),
        cu_seqlens=cu_seqlens_from_lengths(lengths),
        loss_mask=torch.ones(sum(lengths)),
        advantages=torch.randn(sum(lengths), generator=gen),
    ).with_global_denominators()


def lr_per_step(rank: int, port: int, model_dir: str, out_path: str) -> None:
    from rl_fsdp import FSDPBackend
    from rl_launcher.roles.backends import fsdp_config, megatron_config
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.testing import cpu_shim

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    cpu_shim.install()
    lrs = {}
    for schedule in SCHEDULES:
        config = rl_train_config(schedule)
        for name, build in (
            ("fsdp", lambda c: FSDPBackend(fsdp_config(c, model_dir=model_dir))),
            ("megatron", lambda c: MegatronBackend(megatron_config(c, model_dir=model_dir))),
        ):
            backend = build(config)
            lrs[schedule, name] = [
                backend.train_step(batch())["train/lr"] for _ in range(NUM_STEPS)
            ]
    torch.save(lrs, out_path)
    dist.destroy_process_group()


def test_both_backends_step_the_same_lr_schedule(tmp_path):
    tiny_model(tmp_path / "model")
    out = tmp_path / "lrs.pt"
    mp.spawn(lr_per_step, args=(free_port(), str(tmp_path / "model"), str(out)), nprocs=1)
    lrs = torch.load(out)
    for schedule in SCHEDULES:
        expected = [
            1e-3
            * lr_multiplier(
                step, warmup_steps=2, decay=schedule, total_steps=NUM_STEPS, min_lr_ratio=0.1
            )
            for step in range(NUM_STEPS)
        ]
        assert lrs[schedule, "megatron"] == pytest.approx(lrs[schedule, "fsdp"], rel=1e-12)
        assert lrs[schedule, "megatron"] == pytest.approx(expected, rel=1e-12), schedule
    assert lrs["cosine", "fsdp"][:2] == pytest.approx([5e-4, 1e-3])  # warm-up, then decay
    assert lrs["cosine", "fsdp"][-1] < lrs["linear", "fsdp"][-1] < 1e-3  # 3/4 of the decay
