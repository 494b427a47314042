"""How good is the two-engine runtime's choice? Replays an ``adaptive bench`` report of a two-engine
profile against the per-prompt best engine.

    adaptive bench --data ../shared/data/spec_bench_dev.jsonl --profile /tmp/twofull --skip-first 16 \\
        --per-category 4 --max-new-tokens 64 --methods ar,engines,torch-knn-ssd --out report.json
    python benchmarks/engine_choice_replay.py /tmp/twofull report.json

Each prompt's time on each engine is measured by the report (``ar``: our plain decoding on llama.cpp,
whose every domain decides plain decoding on a 2-core CPU; ``torch-knn-ssd``: the torch member's
routed runtime). Totals over the mix: ``chosen`` (what ``engines`` measured), ``routed-first`` (the
engine the choice would pick if the request's domain were known before it, priced with that domain's
pace on each engine instead of the pace averaged over domains: the engine's time measured by the other
methods), the per-prompt ``oracle`` (the faster measured engine for every prompt) and each engine
alone. Then the value of routing first: for each prompt, the expected time saved by knowing the domain
(each calibrated domain weighted by its calibration prompts) against what an embedding before the choice
would cost (the torch engine's prefill of the prompt up to the routing layer, ``layer / n_layers`` of
its measured prefill).
"""

from __future__ import annotations

import argparse
import collections
import json

ENGINE_METHODS = {"llama.cpp": "ar", "torch": "torch-knn-ssd"}  # the report's method for each engine alone


def totals(prompts: list[dict]) -> dict[str, float]:
    """Seconds over the mix of each way of choosing. Each prompt: ``measured`` (engine -> seconds),
    ``chosen`` (seconds the two-engine runtime took) and ``routed_first`` (the engine it would choose
    knowing the domain). Example: two prompts measured ``{a: 1, b: 2}`` and ``{a: 3, b: 1}``, chosen 1.1
    and 2.9, routed first ``a`` and ``b``: chosen 4.0, routed-first 2.0, oracle 2.0, a 4.0, b 3.0."""
    out = collections.Counter()
    for p in prompts:
        m = p["measured"]
        out["chosen"] += p["chosen"]
        out["routed-first"] += m[p["routed_first"]]
        out["oracle"] += min(m.values())
        for engine, s in m.items():
            out[engine] += s
    return {k: round(v, 4) for k, v in out.items()}


def routing_value(expected: dict[str, dict[str, float]], weights: dict[str, float]) -> float:
    """Expected seconds saved by knowing a prompt's domain before choosing its engine: ``expected``
    (domain -> engine -> expected seconds), each domain weighted by ``weights``. Without the domain the
    choice is the engine least in expectation over the domains; with it, each domain's own best.
    Example: ``{d1: {a: 1, b: 2}, d2: {a: 2, b: 1.5}}``, equal weights: ``a`` is least in expectation
    (1.5 against 1.75), knowing the domain gives (1 + 1.5) / 2 = 1.25: 0.25 saved."""
    total = sum(weights[d] for d in expected)
    engines = next(iter(expected.values())).keys()
    blind = min(sum(weights[d] * expected[d][e] for d in expected) for e in engines) / total
    informed = sum(weights[d] * min(expected[d].values()) for d in expected) / total
    return blind - informed


def main() -> None:
    from adaptive.profile import load_profile
    from adaptive.runtime.engines import estimate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="a two-engine profile directory")
    ap.add_argument("report", help="an adaptive bench report with methods ar, engines and torch-knn-ssd")
    args = ap.parse_args()
    members = {e: load_profile(args.profile, e) for e in ENGINE_METHODS}
    torch_profile = members["torch"]
    layer = torch_profile.index.pooling.layer or torch_profile.model.n_layers
    share = layer / torch_profile.model.n_layers
    report = json.load(open(args.report))
    n_new = int(report["settings"]["max_new_tokens"])  # what the choice prices: where a request stops is unknown
    runs = collections.defaultdict(dict)
    for r in report["runs"]:
        runs[(r["group"], r["id"])][r["method"]] = r
    weights = {d: max(rec.prompts, 1) for d, rec in torch_profile.domains.items()}
    prompts, saved, cost, open_choices = [], 0.0, 0.0, 0
    print("group id prompt | expected on each engine, its own domain | measured | chosen -> routed first")
    for (group, pid), methods in sorted(runs.items()):
        if "engines" not in methods or any(m not in methods for m in ENGINE_METHODS.values()):
            continue
        n_prompt = methods["ar"]["prompt_tokens"]
        by_domain = {d: {e: estimate(p, n_prompt, n_new, domain=d).expected_s for e, p in members.items()}
                     for d in torch_profile.domains}
        own = by_domain.get(group)
        measured = {e: methods[m]["seconds"] for e, m in ENGINE_METHODS.items()}
        first = min(own, key=own.get) if own else methods["engines"]["engine"]
        prompts.append({"measured": measured, "chosen": methods["engines"]["seconds"], "routed_first": first})
        value = routing_value(by_domain, weights)
        if value > 0:  # the domain could change the choice: only there would a gated router embed first
            open_choices += 1
            saved += value
            cost += share * torch_profile.cost_model.prefill_seconds(n_prompt)
        print(f"{group[:12]:12s} {pid:>4} {n_prompt:5d} | "
              + (" ".join(f"{e} {s:.2f}" for e, s in own.items()) if own else "-")
              + " | " + " ".join(f"{e} {s:.2f}" for e, s in measured.items())
              + f" | {methods['engines']['engine']} -> {first}")
    print("totals over the mix (s):", totals(prompts))
    print(f"routing first: on {open_choices} of {len(prompts)} prompts the domain could change the choice; "
          f"knowing it is expected to save {saved:.2f} s there, for {cost:.2f} s of embeddings ({layer} of "
          f"{torch_profile.model.n_layers} layers of the torch engine's measured prefill of each)")


if __name__ == "__main__":
    main()
