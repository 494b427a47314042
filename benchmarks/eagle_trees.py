"""The eagle head drafting chains against trees of several shapes (issue 61; design.md, "Trees").

Each arm is its own :class:`~adaptive.runtime.AdaptiveRuntime` over one loaded model (so each has its
own Thompson bandits, as each method of ``adaptive bench`` has), decoding the held-out prompts with the
``eagle`` policy (``--policy`` for another one), the arms interleaved prompt by prompt in an order
that rotates, with ``ar`` as the reference. An arm is ``chain`` or ``WxN`` / ``WxN@P``: a
:class:`~adaptive.drafters.eagle.TreeShape` of width ``W``, ``N`` nodes and the probability floor ``P``
(0 unless given). Reported per arm: tau (tokens per target forward), nodes verified a step, the
draft's and the verification's milliseconds a step, decoding tokens/s (after the prefill; the
aggregate over the prompts) and the per-prompt mean of tokens/s with the prefill; greedy outputs
audited against ``ar``'s (bf16: equal, or parting at a near-tie; a violation otherwise).

Progress on stderr, the JSON report on stdout::

    python benchmarks/eagle_trees.py --profile /tmp/tp61 --arms chain,4x10,4x10@0.05,4x10@0.15
    python benchmarks/eagle_trees.py --profile /tmp/tp61 --arms chain,4x10@0.05 --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
import sys

from adaptive.bench.data import load_bench_prompts
from adaptive.drafters.eagle import TreeShape
from adaptive.engine.audit import audit_divergence
from adaptive.runtime import AdaptiveRuntime


def parse_arm(text: str) -> TreeShape | None:
    """``chain`` -> ``None``; ``4x10@0.05`` -> ``TreeShape(4, 10, 0.05)``; ``3x8`` -> ``TreeShape(3, 8)``."""
    if text == "chain":
        return None
    shape, _, floor = text.partition("@")
    width, nodes = shape.split("x")
    return TreeShape(int(width), int(nodes), float(floor or 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a torch-engine profile with an eagle head")
    ap.add_argument("--arms", default="chain,4x10@0.05", help="comma-separated: chain or WxN[@P]")
    ap.add_argument("--data", default="../shared/data/spec_bench_dev.jsonl")
    ap.add_argument("--skip-first", type=int, default=16)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (audited); else seeded per prompt")
    ap.add_argument("--policy", default="eagle")
    args = ap.parse_args()
    arms = {a: parse_arm(a) for a in args.arms.split(",")}
    base = AdaptiveRuntime.from_profile(args.profile, online=False, prefix_cache=0)
    runtimes = {"ar": base, **{a: AdaptiveRuntime(base.profile, base.lm, online=False, prefix_cache=0, tree=t)
                              for a, t in arms.items()}}
    prompts = load_bench_prompts(args.data, per_category=args.per_category, skip_first=args.skip_first)
    base.generate("Hello", max_new_tokens=8, policy="ar")  # warm-up
    names = list(runtimes)
    rows = {a: [] for a in names}
    violations = {a: 0 for a in arms}
    for i, p in enumerate(prompts):
        ids = base.encode(p.turns[0], None)
        out = {}
        for a in names[i % len(names):] + names[:i % len(names)]:
            r = runtimes[a].generate(p.turns[0], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     seed=i, policy="ar" if a == "ar" else args.policy)
            s = r.stats
            out[a] = r.token_ids
            rows[a].append(dict(seconds=s.total_time, prefill=s.prefill_time, tokens=s.tokens, steps=s.steps,
                                accepted=s.accepted, nodes=s.drafted, draft=s.draft_time, verify=s.verify_time))
        if args.temperature == 0:
            for a in arms:
                violations[a] += bool(audit_divergence(base.lm.backbone, ids, out["ar"], out[a]).violation)
        print(f"{i + 1}/{len(prompts)} {p.group}: " + ", ".join(
            f"{a} {rows[a][-1]['tokens'] / rows[a][-1]['seconds']:.1f}" for a in names), file=sys.stderr)
    report = {"profile": args.profile, "policy": args.policy, "temperature": args.temperature,
              "prompts": len(prompts), "arms": {}}
    for a in names:
        r = rows[a]
        total = {k: sum(x[k] for x in r) for k in r[0]}
        steps = max(total["steps"], 1)
        report["arms"][a] = {
            "tau": round((total["steps"] + total["accepted"]) / steps, 3),
            "nodes_per_step": round(total["nodes"] / steps, 2),
            "draft_ms_per_step": round(1e3 * total["draft"] / steps, 2),
            "verify_ms_per_step": round(1e3 * total["verify"] / steps, 2),
            "decode_tok_s": round((total["tokens"] - len(r)) / (total["seconds"] - total["prefill"]), 2),
            "mean_tok_s": round(sum(x["tokens"] / x["seconds"] for x in r) / len(r), 2),
            **({"violations": violations[a]} if a in violations and args.temperature == 0 else {}),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
