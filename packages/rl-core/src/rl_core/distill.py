"""On-policy distillation (OPD): a teacher scores the student's own sampled tokens.

The student samples a response; a teacher gives its log-prob of each sampled token. The
per-token reverse-KL estimate ``log pi_student(t) - log pi_teacher(t)`` (the k1 estimator,
sampled under the student) is subtracted from the advantage, scaled by ``coef``:

    A'_t = A_t - coef * (log pi_student(t) - log pi_teacher(t))

as slime's ``--use-opd`` does (``apply_opd_kl_to_advantages``), so it adds to any advantage
estimator (pass zeros for pure distillation). Neither centred nor scaled by itself; with
``whiten=True`` the sum is whitened over the batch's tokens afterwards, as slime's
``--normalize-advantages`` whitens it (the estimator's own advantages must then come in
unwhitened). The student log-probs are those the advantage is computed against (the
rollout's or the trainer's old log-probs), never differentiated through.
"""

import torch

from rl_core._dtype import wide
from rl_core.advantages import whiten as whitened


def opd_advantages(
    advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float = 1.0,
    whiten: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``advantages`` ``[B, T]`` (or packed ``[N]``) with the teacher's per-token penalty,
    then whitened over the masked tokens when ``whiten``.

    Returns the new advantages (zero outside ``mask``) and ``opd/reverse_kl``, the mean
    per-token reverse-KL estimate over the masked tokens, plus ``opd/teacher_log_prob``.
    """
    if coef < 0:
        raise ValueError(f"opd coef must be >= 0, got {coef}")
    mask = mask.to(torch.bool)
    reverse_kl = (wide(student_log_probs) - wide(teacher_log_probs)).detach()
    shaped = wide(advantages) - coef * reverse_kl
    shaped = torch.where(mask, shaped, torch.zeros_like(shaped))
    if whiten:
        shaped = whitened(shaped, mask)
    count = max(int(mask.sum()), 1)
    metrics = {
        "opd/reverse_kl": float(reverse_kl[mask].sum()) / count,
        "opd/teacher_log_prob": float(wide(teacher_log_probs)[mask].sum()) / count,
    }
    return shaped, metrics
