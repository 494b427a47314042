"""Online adaptation on the embedded model (issue 20's targets), in process, one model load.

Part 1, a new domain from traffic. ``--without`` is a profile calibrated without one group (by
default ``translation``), ``--with`` one calibrated with it. The runtime of ``--without`` (online
learning on, measuring in the background) serves that group's first ``--learn`` held-out prompts
one after another: how many the calibrated index flags out-of-domain, when a domain is learned.
It then waits for a running measurement and decodes the next ``--eval`` prompts; on each of
them, interleaved in rotating order, plain decoding (``ar``), the adapted runtime, the same
profile without online learning and the ``--with`` profile's runtime (online off): speedups over
``ar`` on the same prompts (decode time, the prefill excluded: the same forward for every method).

Part 2, online tables on in-domain traffic. Two fresh runtimes of ``--without``, online learning
on and off, both serve ``--warm`` held-out prompts of the other groups (round robin), so that
their bandits have seen the same traffic and only the first has learned tables (and whatever
domain it found); then both decode the next ``--eval-in`` prompts, interleaved with ``ar``: the
overall speedups and a paired bootstrap interval of their ratio.

Every greedy output is audited against ``ar``'s (:func:`adaptive.engine.audit.audit_divergence`:
identical, a near-tie, or a violation). Also reported: the learner's update time per request.

    python benchmarks/online_adapt.py --without /tmp/p5-prof --with /tmp/p6-prof \\
        --data /tmp/sb --out /tmp/online.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from adaptive.engine.audit import audit_divergence
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.models import load_model
from adaptive.profile import load_profile
from adaptive.runtime import AdaptiveRuntime, OnlineSettings


def rows(path: Path, skip: int) -> list[str]:
    out = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return [r["prompt"] if "prompt" in r else r["turns"][0] for r in out][skip:]


def decode_s(stats) -> float:
    return max(stats.total_time - stats.prefill_time, 1e-9)


def paired_interval(num: list[float], den: list[float], level: float = 0.9, n_boot: int = 4000) -> list[float]:
    """A bootstrap interval (over prompts) of sum(num) / sum(den): two methods' seconds on the same prompts."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(num), np.asarray(den)
    idx = rng.integers(0, len(a), size=(n_boot, len(a)))
    ratios = a[idx].sum(1) / b[idx].sum(1)
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return [round(float(lo), 3), round(float(hi), 3)]


def timed(methods: dict, prompts: list[str], max_tokens: int, engine: Engine, audit_bb) -> dict:
    """Each prompt decoded by every method (rotating order); per method its decode seconds, tokens, tokens/s
    over all prompts, speedup over ``ar`` (tokens/s ratio: outputs may part at bf16 near-ties and differ in
    length), per-prompt seconds per token (``per_prompt``) and the audit against ``ar``."""
    out = {name: {"seconds": 0.0, "tokens": 0, "identical": 0, "near_ties": 0, "violations": 0, "margins": [],
                  "per_prompt": []} for name in ["ar", *methods]}
    for i, prompt in enumerate(prompts):
        order = ["ar", *methods]
        order = order[i % len(order):] + order[: i % len(order)]
        results = {}
        for name in order:
            if name == "ar":
                r = engine.generate([{"role": "user", "content": prompt}], GenerationConfig(max_new_tokens=max_tokens))
            else:
                r = methods[name](prompt)
            results[name] = r
            out[name]["seconds"] += decode_s(r.stats)
            out[name]["tokens"] += len(r.token_ids)
            out[name]["per_prompt"].append(round(decode_s(r.stats) / max(len(r.token_ids), 1), 5))
            if getattr(r, "online", None) is not None:
                out[name].setdefault("routes", []).append(r.applied)
        ref = results["ar"].token_ids
        ids = engine.encode([{"role": "user", "content": prompt}])
        for name in methods:
            a = audit_divergence(audit_bb, ids, ref, results[name].token_ids)
            key = "identical" if a.identical else ("violations" if a.violation else "near_ties")
            out[name][key] += 1
            if not a.identical:
                out[name]["margins"].append(round(a.margin, 4))
        print(f"  prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{n} {results[n].stats.tokens_per_s:.1f}" for n in order), file=sys.stderr, flush=True)
    for name in out:
        out[name]["tokens_per_s"] = round(out[name]["tokens"] / out[name]["seconds"], 2)
    for name in methods:
        out[name]["speedup"] = round(out[name]["tokens_per_s"] / out["ar"]["tokens_per_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--without", required=True, help="profile calibrated without --group")
    ap.add_argument("--with", dest="with_", required=True, help="profile calibrated with it")
    ap.add_argument("--data", required=True, help="directory of per-group JSONL files (specbench_domains.py)")
    ap.add_argument("--group", default="translation")
    ap.add_argument("--skip", type=int, default=16, help="prompts per group the profiles were calibrated on")
    ap.add_argument("--learn", type=int, default=16)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--warm", type=int, default=32)
    ap.add_argument("--eval-in", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="default: the profile's")
    ap.add_argument("--skip-part2", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    without, with_ = load_profile(args.without), load_profile(args.with_)
    lm = load_model(without.model.spec or without.model.name, dtype=args.dtype or without.model.dtype or "auto",
                    weights=without.model.weights)
    engine = Engine(lm)
    data = Path(args.data)
    group = rows(data / f"{args.group}.jsonl", args.skip)
    report: dict = {"model": lm.name, "dtype": str(lm.dtype), "max_tokens": args.max_tokens, "group": args.group}
    tmp = Path(tempfile.mkdtemp(prefix="online-bench-"))

    def gen(rt, policy="knn-ssd"):
        return lambda p: rt.generate([{"role": "user", "content": p}], max_new_tokens=args.max_tokens, policy=policy)

    # -- part 1: a new domain ---------------------------------------------------------------------
    adapted = AdaptiveRuntime(without, lm, online=OnlineSettings(path=tmp / "p1.online"), prefix_cache=0)
    learn = []
    audit = {"identical": 0, "near_ties": 0, "violations": 0}
    t0 = time.perf_counter()
    for i, prompt in enumerate(group[: args.learn]):
        r = gen(adapted)(prompt)
        learn.append({"flagged": r.online["flagged"], "applied": r.applied, "drafter": r.drafter,
                      "measuring": adapted.online.measuring, "learned": sorted(adapted.online.learned)})
        msgs = [{"role": "user", "content": prompt}]  # audited against ar (untimed: a measurement may be running)
        ref = engine.generate(msgs, GenerationConfig(max_new_tokens=args.max_tokens)).token_ids
        a = audit_divergence(lm.backbone, engine.encode(msgs), ref, r.token_ids)
        audit["identical" if a.identical else ("violations" if a.violation else "near_ties")] += 1
        print(f"learn {i + 1}: flagged {r.online['flagged']}, applied {r.applied}, measuring "
              f"{adapted.online.measuring}, learned {sorted(adapted.online.learned)}", file=sys.stderr, flush=True)
    t_wait = time.perf_counter()
    adapted.online.wait()
    waited = time.perf_counter() - t_wait
    state = adapted.online.state()
    report["part1_learning"] = {"requests": learn, "flagged": sum(x["flagged"] for x in learn), "audit": audit,
                                "seconds": round(time.perf_counter() - t0, 1), "waited_after_s": round(waited, 1),
                                "online": state,
                                "learned_records": {n: {"decision": d.record.decision.to_dict(),
                                                        "measurements": [m.to_dict() for m in d.record.measurements]}
                                                    for n, d in adapted.online.learned.items()}}
    print(json.dumps({k: v for k, v in report["part1_learning"].items() if k != "requests"}, indent=1),
          file=sys.stderr)
    frozen = AdaptiveRuntime(without, lm, online=False, prefix_cache=0)
    calibrated = AdaptiveRuntime(with_, lm, online=False, prefix_cache=0)
    ev = group[args.learn: args.learn + args.eval]
    report["part1_eval"] = timed({"adapted": gen(adapted), "without_online_off": gen(frozen),
                                  "with_group_calibrated": gen(calibrated)}, ev, args.max_tokens, engine, lm.backbone)
    report["part1_eval_routes"] = adapted.online.state()["learned"]
    p1 = report["part1_eval"]
    report["part1_ratio_to_calibrated"] = round(p1["adapted"]["speedup"] / p1["with_group_calibrated"]["speedup"], 3)
    # paired over prompts: seconds per token of the calibrated runtime over the adapted one's (> 1: adapted faster)
    report["part1_ratio_interval_90"] = paired_interval(p1["with_group_calibrated"]["per_prompt"],
                                                        p1["adapted"]["per_prompt"])
    adapted.close()
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "margins"} for k, v in p1.items()}, indent=1),
          file=sys.stderr)

    # -- part 2: online tables on in-domain traffic ------------------------------------------------
    if not args.skip_part2:
        others = sorted(p for p in data.glob("*.jsonl") if p.stem != args.group)
        groups = [rows(p, args.skip) for p in others]
        group_of = {q: p.stem for p, g in zip(others, groups) for q in g}
        mixed = [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]
        warm, ev_in = mixed[: args.warm], mixed[args.warm: args.warm + args.eval_in]
        online = AdaptiveRuntime(without, lm, online=OnlineSettings(path=tmp / "p2.online"), prefix_cache=0)
        offline = AdaptiveRuntime(without, lm, online=False, prefix_cache=0)
        t0 = time.perf_counter()
        warm_log = []
        for prompt in warm:  # both serve the warm-up traffic: their bandits learn alike, only one learns online
            r = gen(online)(prompt)
            gen(offline)(prompt)
            warm_log.append({"group": group_of[prompt], "flagged": r.online["flagged"], "applied": r.applied})
        online.online.wait()
        report["part2_warm_seconds"] = round(time.perf_counter() - t0, 1)
        report["part2_warm"] = warm_log
        report["part2_warm_flagged"] = f"{sum(x['flagged'] for x in warm_log)}/{len(warm)}"  # in-domain, flagged
        report["part2_eval"] = timed({"online": gen(online), "offline": gen(offline)}, ev_in, args.max_tokens,
                                     engine, lm.backbone)
        p2 = report["part2_eval"]
        report["part2_eval_groups"] = [group_of[p] for p in ev_in]
        report["part2_ratio"] = round(p2["online"]["speedup"] / p2["offline"]["speedup"], 3)
        report["part2_ratio_interval_90"] = paired_interval(p2["offline"]["per_prompt"], p2["online"]["per_prompt"])
        report["part2_online_state"] = online.online.state()
        online.close()
        print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "margins"}
                          for k, v in report["part2_eval"].items()}, indent=1), file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
