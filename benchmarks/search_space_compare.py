"""Compare the two search spaces at equal trials on one domain (estimated speedup, no timing).

    python benchmarks/search_space_compare.py --domain /tmp/sb/math_reasoning.jsonl --prompts 16 --trials 30 \
        --seeds 0,1,2

Prepares the domain as calibration does (greedy continuations, influence), measures the cost model
once, then runs the Bayesian search in the ``ranked`` and ``sublayer`` spaces with the same scorer,
cost model, trials and seeds, and prints the best estimated speedup each reached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adaptive.calibrate.search import MatchnessScorer, estimate, make_space, run_search, top_candidates
from adaptive.calibrate.sources import read_prompt_rows
from adaptive.costs import measure_costs
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--domain", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--init", type=int, default=6)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    lm = load_model("smollm2-135m", engine="torch")  # layer skipping: the torch engine
    engine, bb = Engine(lm), lm.backbone
    seqs, influence = [], torch.zeros(2, bb.n_layers)
    for row in read_prompt_rows(args.domain)[: args.prompts]:
        ids = engine.encode(row["prompt"])
        cont = engine.generate(ids, GenerationConfig(max_new_tokens=args.tokens)).token_ids
        tail = (ids + cont)[-(len(cont) + 64):]
        influence += bb.sublayer_influence(torch.tensor(tail), from_position=len(tail) - len(cont))
        seqs.append((ids, cont))
    costs = measure_costs(bb)
    scorer = MatchnessScorer(bb, seqs)
    out = {}
    for name in ("ranked", "sublayer"):
        space = make_space(name, bb.n_layers, influence)
        best, t0 = [], time.perf_counter()
        for seed in [int(s) for s in args.seeds.split(",")]:
            hist = run_search(space, lambda skip: estimate(skip, scorer, costs), args.trials, seed=seed,
                              n_init=args.init)
            top = top_candidates(hist, 1)[0]
            best.append((top["target"], top["skip"], top["matchness"]))
        out[name] = {"best_estimated_speedup": [round(b[0], 4) for b in best],
                     "median": round(statistics.median(b[0] for b in best), 4),
                     "best_sets": [b[1] for b in best], "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps({"domain": args.domain, "trials": args.trials, "prompts": args.prompts, **out}, indent=1))


if __name__ == "__main__":
    main()
