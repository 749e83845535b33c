"""``sdpa_grouped``: packed sequences attended in a few batched SDPA calls.

One SDPA call per sequence (``sdpa_per_doc``) launches ``B`` kernels per layer: fine for
a few long sequences, ruinous for an RL micro-batch of hundreds of short ones (the GPU
idles between launches). Here sequences of similar length form a group: each group is
gathered into a right-padded batch ``[n, H, L, D]`` (``L`` = its longest sequence) and run
as one causal SDPA call. Right padding with a causal mask is exact: a real query never
sees a padded key, which all come after it; padded queries are dropped. A group holds
sequences at least half as long as its longest, so padding wastes at most half of a
group and there are about ``log2(longest / shortest) + 1`` calls per layer.

The index tensors are built once per forward pass (host lengths, no device sync) and
shared by all layers; gathering and scattering are ``index_select`` calls, so autograd
flows through them.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rl_core.batch import to_device


@dataclass(frozen=True)
class Group:
    """Sequences padded to one length: ``gather`` ``[n · L]`` token index per padded slot
    (pads repeat the sequence's last token), ``keep`` ``[Σ l]`` the slots of real tokens."""

    gather: torch.Tensor
    keep: torch.Tensor
    num_seqs: int
    length: int


def group_by_length(lengths: tuple[int, ...]) -> list[list[int]]:
    """Sequence indices grouped so each group's lengths lie within a factor 2 of its
    longest (longest first; zero-length sequences are left out)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and 2 * lengths[i] >= lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def build_groups(lengths: tuple[int, ...], device) -> tuple[list[Group], torch.Tensor]:
    """The groups of one packed row and ``restore`` ``[N]``: for each packed token, its
    position in the concatenation of all groups' kept outputs."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    groups, order = [], []
    for members in group_by_length(lengths):
        width = lengths[members[0]]
        gather, keep = [], []
        for row, i in enumerate(members):
            n, start = lengths[i], starts[i]
            gather += [start + min(t, n - 1) for t in range(width)]
            keep += [row * width + t for t in range(n)]
            order += range(start, start + n)
        groups.append(Group(_ids(gather, device), _ids(keep, device), len(members), width))
    restore = torch.empty(len(order), dtype=torch.long)
    restore[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return groups, to_device(restore, device)


def _ids(values: list[int], device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.long), device)


def grouped_attention(query, key, value, groups: list[Group], restore, scaling, dropout):
    """``query/key/value [1, H, N, D]`` (key/value already repeated for GQA) ->
    ``[1, H, N, D]``, each packed sequence attending causally to itself only."""
    outs = []
    for group in groups:
        q, k, v = (_padded(t, group) for t in (query, key, value))  # [n, H, L, D]
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True
        )
        heads, dim = out.shape[1], out.shape[3]
        flat = out.transpose(0, 1).reshape(heads, group.num_seqs * group.length, dim)
        outs.append(flat.index_select(1, group.keep))  # [H, Σ l, D]
    return torch.cat(outs, dim=1).index_select(1, restore).unsqueeze(0)


def _padded(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    heads, dim = tensor.shape[1], tensor.shape[3]
    picked = tensor[0].index_select(1, group.gather)  # [H, n·L, D]
    return picked.view(heads, group.num_seqs, group.length, dim).transpose(0, 1)
