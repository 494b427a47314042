"""Online distillation of the eagle head on a domain's traffic (issue 61, item 6).

``--profile``: a torch-engine profile with an eagle head trained *without* the domain (e.g. calibrated
and distilled on five Spec-Bench groups, the sixth served here). The domain's ``--traffic`` prompts are
served in turn through the runtime (routed, greedy, ``--max-new-tokens``) with online learning on (in
memory: it may learn the domain from the requests the index calls out-of-domain) and a
:class:`~adaptive.distill.refine.HeadRefiner` attached as ``adaptive serve`` attaches it (its own
thread, a ``ShareGuard`` over the model lock, the server's settings unless ``--every``/``--steps``).
Once the traffic is served the rounds still due finish, the refiner is closed, and on ``--eval`` prompts
(never served):

1. **acceptance**: each eval prompt's greedy continuation with its feature rows; the head's held-out
   acceptance per draft position and tau (as ``adaptive distill`` evaluates) for the profile's head and
   for the head each prompt's domain drafts with now (its refined one where a round adopted one);
2. **speed**: each eval prompt decoded with the ``eagle`` policy under the refined head and under the
   profile's head, with ``ar``, and routed (``knn-ssd``, the refined heads in place), interleaved (the
   order rotating per prompt), ``--repeats`` times, the prefix cache off: aggregate tokens/s of each and
   their ratios; every other output audited against ``ar``'s (bf16: equal, or parting at a near-tie; a
   violation otherwise).

Progress on stderr, the JSON report on stdout (``--out`` also writes it)::

    python benchmarks/online_heads.py --profile /tmp/on70 --traffic /tmp/sb-train/qa.jsonl --first 32 \\
        --eval /tmp/sb-train/qa.jsonl --eval-skip 32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from adaptive.bench.data import load_bench_prompts
from adaptive.distill.heads import HeadConfig, HeadData, HeadTrainer, decode_with_features
from adaptive.distill.refine import RefineSettings, attach_refiner
from adaptive.engine.audit import audit_divergence
from adaptive.runtime import AdaptiveRuntime, OnlineSettings
from adaptive.runtime.turns import ShareGuard


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompts(path: str, skip: int, n: int | None) -> list[str]:
    rows = [p.turns[0] for p in load_bench_prompts(path)]
    return rows[skip:skip + n if n else None]


def acceptance(rt, head, ids: list[list[int]], domains: list[str], new_tokens: int) -> dict:
    bb = rt.lm.backbone
    decoded = decode_with_features(bb, ids, new_tokens, set(rt.lm.eos_ids()), head.shape.layers)
    data = HeadData.build(decoded, [len(p) for p in ids], domains, head.shape.lookup)
    trainer = HeadTrainer(bb, head.shape, head.ids.cpu(), HeadConfig(layers=head.shape.layers,
                                                                    lookup=head.shape.lookup))
    trainer.head.load_state_dict(head.state_dict())
    with torch.no_grad():
        return trainer.evaluate(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--traffic", required=True, help="the domain's prompts served (JSONL)")
    ap.add_argument("--first", type=int, default=32, help="traffic prompts served")
    ap.add_argument("--eval", required=True, help="held-out prompts (JSONL)")
    ap.add_argument("--eval-skip", type=int, default=0)
    ap.add_argument("--eval-count", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--every", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--min-held", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    # no prefix cache: every arm of a prompt starts from its own prefill (a cached prefix parts from a fresh
    # prefill at bf16 near-ties, and would give the later arms a shorter prefill)
    rt = AdaptiveRuntime.from_profile(args.profile, online=OnlineSettings(persist=False), prefix_cache=0)
    base = dict(RefineSettings().__dict__)
    if args.every:
        base["every"] = args.every
    for name in ("steps", "lr", "min_held"):
        if getattr(args, name):
            base[name] = getattr(args, name)
    settings = RefineSettings(**{**base, "persist": False})
    share = OnlineSettings()
    refiner = attach_refiner(rt, settings, guard_for=lambda lock: ShareGuard(lock, share.share, share.idle_s))
    if refiner is None:
        raise SystemExit(f"{args.profile}: no engine drafts with an eagle head")
    base_head = refiner.base
    report: dict = {"profile": args.profile, "settings": settings.__dict__, "traffic": args.traffic}

    served = prompts(args.traffic, 0, args.first)
    t0 = time.perf_counter()
    applied = []
    for i, p in enumerate(served):
        r = rt.generate(p, max_new_tokens=args.max_new_tokens)
        applied.append(r.applied)
        if (i + 1) % 8 == 0:
            say(f"served {i + 1}/{len(served)} (domains {sorted(set(applied))}; rounds {len(refiner.history)})")
    serve_s = time.perf_counter() - t0
    if not refiner.wait(900):  # the rounds still due, the server idle now
        say("rounds still running after 15 minutes: closing the refiner")
    refiner.close()
    report["serve_seconds"] = round(serve_s, 1)
    report["applied"] = {d: applied.count(d) for d in sorted(set(applied))}
    report["rounds"] = [r.to_dict() for r in refiner.history]
    report["refiner"] = refiner.state()
    learned = rt.online.state().get("learned", []) if rt.online is not None else []
    report["learned"] = learned
    for r in refiner.history:
        say(f"round {r.round} of {r.domain}: {r.before:.3f} -> {r.after:.3f} over {r.held_rows} held-out positions, "
            f"{'adopted' if r.adopted else 'kept'} ({r.seconds:.0f} s)")

    held = prompts(args.eval, args.eval_skip, args.eval_count)
    routes = [rt.route(p).applied for p in held]
    adopted = rt.eagle_heads()
    now = {d: rt.refined_eagle(d) for d in set(routes)}  # what each eval domain drafts with (None: the profile's)
    report["eval_domains"] = {d: routes.count(d) for d in sorted(set(routes))}
    report["eval_refined"] = sorted(d for d, h in now.items() if h is not None)
    ids = [rt.encode(p) for p in held]
    say(f"held-out acceptance over {len(held)} prompts (domains {report['eval_domains']}; drafting with a refined "
        f"head: {report['eval_refined']}) ...")
    report["acceptance_base"] = acceptance(rt, base_head, ids, routes, args.max_new_tokens)
    by_domain = {}
    for d in sorted(set(routes)):
        sel = [i for i, x in enumerate(routes) if x == d]
        by_domain[d] = acceptance(rt, now[d] or base_head, [ids[i] for i in sel], [d] * len(sel),
                                  args.max_new_tokens)
    rows = sum(v["rows"] for v in by_domain.values())
    report["acceptance_refined"] = {
        "positions": [round(sum(v["positions"][k] * v["rows"] for v in by_domain.values()) / max(rows, 1), 4)
                      for k in range(3)], "by_domain": by_domain}
    report["acceptance_refined"]["tau"] = round(1 + sum(report["acceptance_refined"]["positions"]), 4)
    say(f"first draft kept: profile's head {report['acceptance_base']['positions'][0]:.3f}, refined "
        f"{report['acceptance_refined']['positions'][0]:.3f}")

    arms = ("refined", "base", "ar", "routed")
    tokens = dict.fromkeys(arms, 0)
    seconds = dict.fromkeys(arms, 0.0)
    steps = dict.fromkeys(arms, 0)
    differing, violations = 0, 0
    for rep in range(args.repeats):
        for i, p in enumerate(held):
            order = arms[(i + rep) % len(arms):] + arms[:(i + rep) % len(arms)]
            out = {}
            for arm in order:
                if arm == "base":  # the profile's head everywhere for this request
                    for d in adopted:
                        rt.set_eagle_head(d, None)
                policy = {"ar": "ar", "routed": "knn-ssd"}.get(arm, "eagle")
                r = rt.generate(p, max_new_tokens=args.max_new_tokens, policy=policy)
                if arm == "base":
                    for d, h in adopted.items():
                        rt.set_eagle_head(d, h)
                tokens[arm] += r.stats.tokens
                seconds[arm] += r.stats.total_time
                steps[arm] += r.stats.steps + 1
                out[arm] = r.token_ids
            for arm in ("refined", "base", "routed"):  # lossless: ar's output, or a bf16 near-tie the audit accepts
                a = audit_divergence(rt.lm.backbone, ids[i], out["ar"], out[arm])
                differing += not a.identical
                violations += bool(a.violation)
        say(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{a} {tokens[a] / seconds[a]:.1f} tok/s" for a in arms))
    report["speed"] = {a: {"tok_s": round(tokens[a] / seconds[a], 2), "tau": round(tokens[a] / max(steps[a], 1), 3)}
                       for a in arms}
    speed = report["speed"]
    for a, b in (("refined", "base"), ("refined", "ar"), ("base", "ar"), ("routed", "ar")):
        speed[f"{a}_over_{b}"] = round(speed[a]["tok_s"] / speed[b]["tok_s"], 3)
    report["outputs_differing_from_ar"] = differing
    report["violations"] = violations
    rt.close()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
