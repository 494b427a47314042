"""The chi-square check of speculative sampling: a tiny vocabulary, a three-token prompt, and the
exact target joint of the two tokens that come from one speculative step, to compare a drafter's
sampled counts against (``tests/engine/test_sampling_distribution.py`` and the drafters' tests)."""

import itertools

import torch
from scipy.stats import chisquare

from adaptive.engine.config import GenerationConfig
from adaptive.engine.sampling import warp_probs
from tests.helpers.decoding import decode_ids

V = 6
PROMPT = [1, 4, 2]
CFG = GenerationConfig(max_new_tokens=3, temperature=1.0, draft_len=2, ignore_eos=True)
N = 3000


def target_joint(lm):
    """Exact P(t2, t3) under the target, marginalised over t1: the two tokens that come from a
    speculative step (t1 comes from the prefill)."""
    m = lm.model
    probs = torch.zeros(V, V)
    with torch.no_grad():
        p1 = warp_probs(m(torch.tensor([PROMPT])).logits[0, -1], 1.0)
        for t1, t2 in itertools.product(range(V), range(V)):
            logits = m(torch.tensor([PROMPT + [t1, t2]])).logits[0]
            p2 = warp_probs(logits[-2], 1.0)[t2]
            p3 = warp_probs(logits[-1], 1.0)
            probs[t2] += p1[t1] * p2 * p3
    return probs


def sample_counts(lm, drafter, acceptor=None, cfg=CFG):
    """``drafter``: a drafter, or a function that makes one per request (a drafter with state of its own)."""
    counts = torch.zeros(V, V)
    kwargs = {"acceptor": acceptor} if acceptor else {}
    for seed in range(N):
        run = GenerationConfig(**{**cfg.__dict__, "seed": seed})
        toks = decode_ids(lm.backbone, PROMPT, run, drafter() if callable(drafter) else drafter, **kwargs)
        counts[toks[1], toks[2]] += 1
    return counts


def chi2_pvalue(counts, probs):
    keep = probs.flatten() * N >= 5
    obs = counts.flatten()[keep]
    exp = probs.flatten()[keep] * N
    exp = exp * obs.sum() / exp.sum()
    return chisquare(obs.numpy(), exp.numpy()).pvalue
