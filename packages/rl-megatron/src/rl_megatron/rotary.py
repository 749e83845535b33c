"""Rotary embedding from a cos/sin table made once per sequence length, not in every layer.

megatron-core hands every layer the rotary angles ``freqs [s, 1, 1, d]`` and its
``_apply_rotary_pos_emb_bshd`` takes their cosine and sine in each layer, for the queries
and again for the keys, for every element of ``[s, b, heads, d]``. On the 1.5B shape (an
H200, 2026-11-27) the table removed a 1.5 ms kernel of cos and sin a step; the compiled
layers' rotary kernel, which also splits the fused q/k/v output, stayed at 0.26 ms a layer
(7.4 ms a step, against 0.28 without the table): its cost is the split, not the cos and sin.

With :func:`use_cos_sin_table` the model's ``RotaryEmbedding`` returns instead a table
``[s, 1, 1, 2, d]``: ``cos(freqs)`` and ``sin(freqs)`` already in the parameters' dtype
(megatron's cached angles, so the table too is made once per length and CP rank), and
megatron's attention, given a 5-D table, applies it with loads and multiply-adds only
(:func:`apply_rotary_from_table`). The result is the same to the bit as megatron's for the
same cos and sin values: the same multiply, rotate-half and add in the same dtype
(``mscale`` is 1 for plain rope, and the table keeps megatron's cast of cos and sin to the
queries' dtype). Under compiled layers cos and sin were the compiler's own; now they are
eager torch's, which may differ in the last bit of float32 before the cast.

Only plain rope in the padded (``bshd``) layout takes the table: MLA (its own YaRN rotary),
mrope, YaRN, packed (``thd``) sequences and Transformer Engine's fused rope keep
megatron's path (:func:`table_applies`).
"""

import functools

import torch

TABLE_DIMS = 5  # [s, 1, 1, 2, d]: megatron's angles are 4-D, so a 5-D tensor is a table


def table_applies(model) -> bool:
    """Whether :func:`use_cos_sin_table` can serve ``model`` (a megatron ``GPTModel``)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = model.config
    plain_rope = type(getattr(model, "rotary_pos_emb", None)) is RotaryEmbedding
    return plain_rope and not (config.multi_latent_attention or config.apply_rope_fusion)


def use_cos_sin_table(model) -> bool:
    """Make ``model``'s rotary embedding return the cos/sin table (module docstring) in
    the parameters' dtype. Returns whether it did (False where :func:`table_applies` is
    not). Idempotent."""
    if not table_applies(model):
        return False
    rotary = model.rotary_pos_emb
    if getattr(rotary.forward, "makes_cos_sin_table", False):
        return True
    _route_megatron_attention()
    angles = rotary.forward  # megatron's, cached per (length, offset, packed, CP group)
    dtype = model.config.params_dtype

    @functools.lru_cache(maxsize=32)
    def table(*args, **kwargs) -> torch.Tensor:
        if kwargs.get("packed_seq"):  # thd: megatron's per-sequence slicing of the angles
            return angles(*args, **kwargs)
        return cos_sin_table(angles(*args, **kwargs), dtype)

    table.makes_cos_sin_table = True
    rotary.forward = table
    return True


def cos_sin_table(freqs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[s, 1, 1, 2, d]``: cos and sin of megatron's angles ``freqs [s, 1, 1, d]``, cast
    to ``dtype`` as megatron casts them (to the queries' dtype)."""
    assert freqs.dim() == TABLE_DIMS - 1, f"rotary angles [s, 1, 1, d] expected, got {freqs.shape}"
    return torch.stack([torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)], dim=-2)


def apply_rotary_from_table(t: torch.Tensor, table: torch.Tensor, *, interleaved: bool):
    """megatron's ``_apply_rotary_pos_emb_bshd`` (no MLA, ``mscale`` 1) with cos and sin
    read from ``table [s, 1, 1, 2, d]``: ``t [s, b, heads, head_dim]``, the first ``d``
    channels rotated, the rest passed through."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    rot_dim = table.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    cos, sin = table.to(t.dtype).unbind(dim=-2)
    rotated = (rotated * cos) + (_rotate_half(rotated, interleaved) * sin)
    return torch.cat((rotated, passed), dim=-1)


@functools.cache
def _route_megatron_attention() -> None:
    """megatron's attention module applies a 5-D rotary input as a table, anything else as
    before (its own ``apply_rotary_pos_emb``)."""
    from megatron.core.transformer import attention

    angles_path = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if freqs.dim() != TABLE_DIMS:
            return angles_path(
                t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group
            )
        assert cu_seqlens is None and mscale == 1.0, "the cos/sin table serves plain bshd rope"
        return apply_rotary_from_table(t, freqs, interleaved=config.rotary_interleaved)

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
