"""Matchness scoring of one skip set: all sequences in one batched forward against one forward each.

Loads ``--model`` on the torch engine (the one that skips layers), takes the first ``--prompts``
prompts of each ``--domains`` file (as ``adaptive calibrate --domains`` reads them) with a
``--tokens``-token continuation each (random ids: the timing does not depend on them), and times,
``--repeats`` times in interleaved rounds, :class:`~adaptive.calibrate.search.MatchnessScorer` with
``max_rows=1`` (one forward per sequence, as before batching) and with the default (every
sequence in one ``forward_batch``); both must give the same matchness. Also times each scorer's
construction (the full model's keys of prompt and continuation: the prefill a search pays once).

    python benchmarks/batched_scoring.py --model qwen2.5-coder-1.5b --domains qa=/tmp/sb/qa.jsonl \\
        --domains rag=/tmp/sb/rag.jsonl
"""

from __future__ import annotations

import argparse
import time

import torch

from adaptive.calibrate.search import MatchnessScorer
from adaptive.calibrate.sources import load_domains
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from adaptive.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--domains", action="append", required=True, metavar="NAME=FILE")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mlp", default="3,5,7,9", help="MLP sublayers skipped (comma-separated)")
    args = ap.parse_args()

    lm = load_model(args.model, engine="torch")
    bb, engine = lm.backbone, Engine(lm)
    masks = SkipSet(mlp=[int(i) for i in args.mlp.split(",")], n_layers=bb.n_layers).masks(bb.n_layers)
    gen = torch.Generator().manual_seed(0)
    print(f"{lm.name} ({lm.dtype}), {args.prompts} prompts x {args.tokens} tokens per domain, skip mlp={args.mlp}")
    heads = ("prompt", "build 1", "build all", "score 1", "score all", "ratio")
    print(f"{'domain':14s} " + " ".join(f"{h:>9s}" for h in heads))
    for name, prompts in load_domains(args.domains).items():
        prompts = prompts[: args.prompts]
        seqs = [(engine.encode(p), torch.randint(100, 1000, (args.tokens,), generator=gen).tolist()) for p in prompts]
        built, scorers = {}, {}
        for label, rows in (("1", 1), ("all", 512)):
            t0 = time.perf_counter()
            scorers[label] = MatchnessScorer(bb, seqs, max_rows=rows)
            built[label] = time.perf_counter() - t0
        times: dict[str, list[float]] = {"1": [], "all": []}
        scores = {}
        for _ in range(args.repeats):  # interleaved: both see the same machine state
            for label, scorer in scorers.items():
                t0 = time.perf_counter()
                scores[label] = scorer(masks)
                times[label].append(time.perf_counter() - t0)
        if scores["1"] != scores["all"]:
            print(f"  note: matchness {scores['1']:.4f} one at a time, {scores['all']:.4f} batched (bf16 rounding)")
        mean_len = sum(len(p) for p, _ in seqs) / len(seqs)
        one, both = min(times["1"]), min(times["all"])
        cells = (f"{mean_len:.0f}", f"{built['1']:.2f}s", f"{built['all']:.2f}s", f"{one:.2f}s", f"{both:.2f}s",
                 f"{both / one:.2f}")
        print(f"{name:14s} " + " ".join(f"{c:>9s}" for c in cells))


if __name__ == "__main__":
    main()
