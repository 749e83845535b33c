"""LoRA adapters on a tiny Qwen2 (bias on q/k/v) and Llama: the model starts as the base,
only adapters train, the adapter state round-trips, and merged weights give the adapted
model's logits in a plain model of the base's shape."""

import pytest
import torch
from fsdp_tiny import CONFIGS
from transformers import AutoConfig, AutoModelForCausalLM

from rl_fsdp.lora import (
    LoRASpec,
    add_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_state_dict,
    merge_lora,
)


def tiny(family: str, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**CONFIGS[family])
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def trained_lora(family: str, spec: LoRASpec):
    model = tiny(family)
    add_lora(model, spec)
    optimizer = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-2)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, ids


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_lora_starts_as_base_and_trains_only_adapters(family):
    base, model = tiny(family), tiny(family)
    spec = LoRASpec(rank=4, alpha=8)
    wrapped = add_lora(model, spec)
    assert len(wrapped) == 2 * 7  # two layers x q, k, v, o, gate, up, down
    ids = torch.randint(0, 512, (2, 10))
    assert torch.equal(logits(model, ids), logits(base, ids))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in lora_parameters(model)] and len(trainable) == 28
    frozen_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained, _ = trained_lora(family, spec)
    for name, param in trained.named_parameters():
        if name in frozen_before:
            assert torch.equal(param, frozen_before[name]), name
    assert not torch.equal(logits(trained, ids), logits(base, ids))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_merged_weights_reproduce_the_adapted_model(family):
    spec = LoRASpec(rank=4, alpha=8)
    model, ids = trained_lora(family, spec)
    merged = dict(merge_lora(model.named_parameters(), scaling=spec.scaling))
    plain = tiny(family, seed=7)  # other weights: everything must come from `merged`
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    plain.load_state_dict(merged, strict=False)
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), atol=1e-5, rtol=1e-5)


def test_adapter_state_round_trips_and_refuses_a_mismatch():
    spec = LoRASpec(rank=4, alpha=8)
    model, ids = trained_lora("llama", spec)
    state = lora_state_dict(model)
    assert all(".lora_" in name for name in state) and len(state) == 28
    fresh = tiny("llama")
    add_lora(fresh, spec)
    load_lora_state_dict(fresh, state)
    assert torch.equal(logits(fresh, ids), logits(model, ids))
    other = tiny("llama")
    add_lora(other, LoRASpec(rank=4, targets=("q_proj",)))
    with pytest.raises(ValueError, match="does not fit"):
        load_lora_state_dict(other, state)


def test_bad_specs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"match no nn\.Linear.*q_proj"):
        add_lora(tiny("llama"), LoRASpec(targets=("query_key_value",)))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRASpec(rank=0)
    with pytest.raises(ValueError, match="without its module's weight"):
        list(merge_lora([("x.lora_A", torch.zeros(1))], scaling=1.0))
