"""Token-level divergences between the target's distribution p and the drafter's q.

Each function takes log-probabilities ``logp``, ``logq``: ``[..., V]`` (rows normalised, e.g.
``log_softmax`` outputs; ``-inf`` allowed for zero-probability tokens) and returns ``[...]``,
one value per position. All are differentiable in ``logq``. Worked example used throughout,
``p = [0.5, 0.5]`` and ``q = [0.25, 0.75]``:

=====================  =============================================================  ==========
divergence             formula                                                        value
=====================  =============================================================  ==========
forward KL  ``fkl``    sum p log(p/q) = 0.5 log 2 + 0.5 log(2/3)                      0.143841
reverse KL  ``rkl``    sum q log(q/p) = 0.25 log 0.5 + 0.75 log 1.5                   0.130812
JSD, beta = 0.5        beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q     0.033822
total variation        0.5 sum |p - q| = 0.5 (0.25 + 0.25)                            0.25
=====================  =============================================================  ==========

Speculative sampling accepts a token drafted from q with probability ``sum min(p, q) = 1 - TVD``
(0.75 above): total variation is the loss that bounds acceptance directly. Forward KL makes q
cover p's mass (mode-covering); reverse KL makes q seek p's modes; the generalised JSD lies
between (beta -> 0 behaves like forward KL scaled by beta, beta -> 1 like reverse KL; DistillSpec).
"""

from __future__ import annotations

import torch

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position; terms with p = 0 contribute 0 (also where q = 0 there)."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def forward_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q). Example above: 0.143841."""
    return _kl(logp, logq)


def reverse_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(q || p). Example above: 0.130812."""
    return _kl(logq, logp)


def jsd(logp: torch.Tensor, logq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence ``beta KL(p||m) + (1-beta) KL(q||m)``, ``m = beta p + (1-beta) q``.

    ``beta`` in (0, 1); 0.5 is the symmetric JSD (example above: 0.033822, at most log 2).
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
    logm = torch.logaddexp(logp + torch.log(torch.tensor(beta, dtype=logp.dtype)),
                           logq + torch.log(torch.tensor(1.0 - beta, dtype=logq.dtype)))
    return beta * _kl(logp, logm) + (1.0 - beta) * _kl(logq, logm)


def tvd(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Total variation ``0.5 sum |p - q|``. Example above: 0.25 (acceptance 0.75)."""
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


def divergence(name: str, logp: torch.Tensor, logq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """The divergence ``name`` (one of :data:`DIVERGENCES`) per position."""
    if name == "fkl":
        return forward_kl(logp, logq)
    if name == "rkl":
        return reverse_kl(logp, logq)
    if name == "jsd":
        return jsd(logp, logq, beta)
    if name == "tvd":
        return tvd(logp, logq)
    raise ValueError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")


def sampling_acceptance(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """The probability that speculative sampling accepts a token drafted from q: ``sum min(p, q)``."""
    return torch.minimum(logp.exp(), logq.exp()).sum(-1)


def greedy_agreement(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """1.0 where the drafter's argmax is the target's (greedy verification accepts it), else 0.0."""
    return (logp.argmax(-1) == logq.argmax(-1)).float()
