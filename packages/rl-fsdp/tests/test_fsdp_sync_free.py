"""No host<->device synchronisation while building and running a micro-batch.

The 'meta' device holds no data, so every read-back of a device value raises there:
``.item()``, ``.tolist()``, ``.cpu()``, ``float()``, ``bool()``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``. A micro-batch that is planned, moved,
run forward and backward on 'meta' therefore proves the same path reads nothing back
from a GPU. Values are checked on CPU against rl_core's own functions.
"""

from dataclasses import replace

import pytest
import torch
from fsdp_tiny import CONFIGS, tokens_batch

from rl_core.batch import next_token_targets
from rl_core.packing import position_ids_from_cu_seqlens
from rl_fsdp import FSDPConfig
from rl_fsdp.backend import FSDPBackend
from rl_fsdp.critic import FSDPCritic
from rl_fsdp.distributed import add_metrics, all_reduce_metrics
from rl_fsdp.forward import micro_batch, packed_log_probs, plan_micro_batches
from rl_fsdp.modeling import build_model
from rl_fsdp.transfer import DeviceMicroBatch, pack, to_device, unpack

META = torch.device("meta")
MANY = [3, 5, 4, 6, 2, 7, 5, 3, 4, 6, 5]  # > 8 sequences: sdpa_grouped really groups


def host_batch(lengths=None):
    batch = tokens_batch() if lengths is None else tokens_batch(lengths)
    gen = torch.Generator().manual_seed(1)
    n = batch.num_tokens
    extra = {"advantages": torch.randn(n, generator=gen), "returns": torch.randn(n, generator=gen)}
    return replace(batch, old_log_probs=-torch.rand(n, generator=gen), **extra)


def meta_trainer(cls, impl: str, **overrides):
    """A backend object on 'meta' without process groups: only what the loss reads."""
    config = FSDPConfig(model_config=CONFIGS["qwen2"], device="cpu", **overrides)
    trainer = cls.__new__(cls)
    with META:
        trainer.model = build_model(config, head=cls.head)
    trainer.config, trainer.attention = config, impl
    return trainer


def test_pack_round_trips_mixed_dtypes_in_one_buffer():
    tensors = {
        "a": torch.arange(5, dtype=torch.int32),
        "b": torch.randn(3, 2, dtype=torch.float64),
        "empty": torch.zeros(0),
        "c": torch.tensor([True, False, True]),
        "d": torch.arange(7, dtype=torch.int64),
    }
    buffer, specs = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 20 + 48 + 0 + 3 + 56
    out = unpack(buffer, specs)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor)


def test_device_micro_batch_holds_what_rl_core_would_compute():
    host = host_batch([0, 4, 3, 5]).with_global_denominators()  # an empty first sequence
    mb = to_device(micro_batch(host, [0, 2, 3]), torch.device("cpu"))
    assert isinstance(mb, DeviceMicroBatch) and mb.host_cu_seqlens.tolist() == [0, 0, 3, 8]
    assert torch.equal(mb.position_ids, position_ids_from_cu_seqlens(mb.cu_seqlens))
    expected = torch.roll(mb.tokens, -1)
    expected[[2, 7]] = 0  # the ends of the two non-empty sequences
    assert torch.equal(next_token_targets(mb.tokens, mb.cu_seqlens), expected)
    assert mb.global_num_tokens == host.global_num_tokens


def test_micro_batches_move_to_the_device_without_reading_it():
    host = host_batch()
    for seqs in [*plan_micro_batches(host, 40), []]:
        mb = to_device(micro_batch(host, seqs), META)
        assert mb.tokens.is_meta and mb.cu_seqlens.is_meta and mb.position_ids.is_meta
        assert mb.loss_mask.is_meta and mb.advantages.is_meta and mb.ref_log_probs is None
        assert mb.host_cu_seqlens.device.type == "cpu"


@pytest.mark.parametrize("impl", ["sdpa_per_doc", "sdpa_mask", "sdpa_grouped"])
def test_forward_and_backward_read_nothing_back(impl):
    model = meta_trainer(FSDPBackend, impl).model
    host = host_batch(MANY)
    for seqs in plan_micro_batches(host, 40):
        mb = to_device(micro_batch(host, seqs), META)
        log_probs, entropy = packed_log_probs(model, mb, impl=impl, with_entropy=True, pad_to=40)
        (log_probs.sum() + entropy.sum()).backward()
        assert log_probs.is_meta and log_probs.shape == (mb.num_tokens,)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_critic_loss_and_metrics_stay_on_the_device():
    critic = meta_trainer(FSDPCritic, "sdpa_per_doc")  # token-mean (see README: seq-mean)
    host = host_batch().with_global_denominators()
    mb = to_device(micro_batch(host, [0, 3, 4]), META)
    loss, metrics = critic.micro_batch_loss(mb)
    loss.backward()
    assert loss.is_meta and all(value.is_meta for value in metrics.values())


@pytest.mark.parametrize("mode", ["rl", "sft"])
def test_actor_loss_and_metrics_stay_on_the_device(mode):
    """The whole per-micro-batch loss, rl-core's objective included (tensor_metrics),
    reads nothing back: on the 'meta' device any read-back raises."""
    actor = meta_trainer(FSDPBackend, "sdpa_per_doc", mode=mode)
    host = host_batch().with_global_denominators()
    mb = to_device(micro_batch(host, [1, 2]), META)
    loss, metrics = actor.micro_batch_loss(mb)
    loss.backward()
    assert loss.is_meta and metrics and all(value.is_meta for value in metrics.values())


def test_metrics_summed_on_the_device_read_back_as_python_sums():
    gen = torch.Generator().manual_seed(0)
    shares = [{"loss/pg": torch.rand((), generator=gen) / 7, "pg/n": 0.1 * k} for k in range(5)]
    sums: dict = {}
    for metrics in shares:
        add_metrics(sums, metrics)
    out = all_reduce_metrics(sums, torch.device("cpu"), unreduced={"norm": torch.tensor(2.5)})
    expected = 0.0
    for metrics in shares:
        expected += float(metrics["loss/pg"])
    assert out["loss/pg"] == expected and out["pg/n"] == sum(0.1 * k for k in range(5))
    assert out["norm"] == 2.5 and list(out) == ["loss/pg", "pg/n", "norm"]
