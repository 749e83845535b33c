"""The run's LoRA adapters (``model.lora_*``) as rl-fsdp's :class:`~rl_fsdp.lora.LoRASpec`,
or None for full fine-tuning (``model.lora_rank: 0``)."""


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
