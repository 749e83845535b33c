"""The static runner's prefill: prompts right-padded into dense batches, run through the
same fused layer pieces as the decode step (:func:`~rl_sglang.engine.layers.prefill_layer`),
with each layer's keys and values written straight into the rows' slots.

Right padding is exact under causal attention (a real token never attends to the padding
after it); the padded positions' keys and values land past the row's length, where the
decode mask hides them until decoding overwrites them. Rows of very different lengths are
prefilled in separate groups, so padding at most doubles a group's tokens.

Shapes: ``N`` prompts in a group, ``L`` its longest prompt, ``H`` hidden, ``V`` vocab.
"""

import torch

from rl_sglang.engine.layers import prefill_layer, rms_norm, signed_sin
from rl_sglang.engine.rows import on_device

MAX_GROUP_TOKENS = 16384  # padded tokens per forward: bounds the activations' memory


def plan_groups(lengths: list[int], max_tokens: int = MAX_GROUP_TOKENS) -> list[list[int]]:
    """Row indices grouped for dense prefills: longest first (rows of equal length keep
    their order), a new group when a row is under half the group's longest or the padded
    group would exceed ``max_tokens``. ``[5, 5, 2, 9] -> [[3, 0, 1], [2]]``."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    groups: list[list[int]] = []
    for row in order:
        if groups:
            longest = lengths[groups[-1][0]]
            fits = (len(groups[-1]) + 1) * longest <= max_tokens
            if fits and 2 * lengths[row] >= longest:
                groups[-1].append(row)
                continue
        groups.append([row])
    return groups


@torch.inference_mode()
def prefill_into_slots(runner, prompts: list[list[int]], first_slot: int) -> torch.Tensor:
    """Fill slots ``first_slot + i`` with the keys/values of ``prompts[i]``; the logits of
    each prompt's last position ``[len(prompts), V]`` (float32), in prompt order."""
    lengths = [len(prompt) for prompt in prompts]
    groups = plan_groups(lengths)
    parts = [_prefill_group(runner, prompts, rows, first_slot) for rows in groups]
    logits_BV = torch.cat(parts) if len(parts) > 1 else parts[0]
    order = [row for rows in groups for row in rows]
    if order == list(range(len(prompts))):
        return logits_BV
    inverse = sorted(range(len(order)), key=order.__getitem__)  # prompt i's row in order
    return logits_BV[on_device(inverse, torch.long, logits_BV.device)]


def _prefill_group(runner, prompts, rows: list[int], first_slot: int) -> torch.Tensor:
    device, inner = runner.device, runner.model.model
    length = max(len(prompts[row]) for row in rows)
    padded = [prompts[row] + [0] * (length - len(prompts[row])) for row in rows]
    ids_NL = on_device(padded, torch.long, device)
    hidden_NLH = inner.embed_tokens(ids_NL)
    cos, sin = inner.rotary_emb(hidden_NLH, torch.arange(length, device=device)[None])
    cos, sin = cos[:, :, None], signed_sin(sin)[:, :, None]  # [1, L, 1, D]
    slots = _slots(rows, first_slot, device)
    for index, layer in enumerate(runner.layers):
        hidden_NLH, keys, values = prefill_layer(
            hidden_NLH, layer.tensors(), cos, sin, runner.eps, runner.num_heads, runner.head_dim
        )
        runner.keys[index][slots, :, :length] = keys
        runner.values[index][slots, :, :length] = values
    last_N = on_device([len(prompts[row]) - 1 for row in rows], torch.long, device)
    hidden_NH = hidden_NLH[torch.arange(len(rows), device=device), last_N]
    return runner.model.lm_head(rms_norm(inner.norm, hidden_NH)).float()


def _slots(rows: list[int], first_slot: int, device) -> slice | torch.Tensor:
    """The rows' slots: a slice when they are consecutive (no index kernel), else indices."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(first_slot + rows[0], first_slot + rows[0] + len(rows))
    return on_device([first_slot + row for row in rows], torch.long, device)
