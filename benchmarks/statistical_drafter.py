"""Teacher-forced acceptance of the statistical drafter (prompt lookup, with or without a bigram table).

    python benchmarks/statistical_drafter.py /tmp/sb/*.jsonl --calib 16 --held-out 8

Per group file: the model's greedy continuations of the first ``--calib`` prompts (``--calib-tokens``)
build the group's bigram table, as calibration does; the next ``--held-out`` prompts are continued
for ``--tokens`` and every position of those continuations is drafted from the context so far and
compared with what the model went on to write. No forward is timed: the figures are acceptance
(per token until the first rejection, and mean accepted per draft), for each ``--min-prob``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from adaptive.calibrate.sources import read_prompt_rows
from adaptive.drafters.ngram import build_bigram_table
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.measure.statistical import statistical_acceptance
from adaptive.models import DEFAULT_MODEL, load_model


def continuations(engine, prompts, tokens):
    cfg = GenerationConfig(max_new_tokens=tokens)
    out = []
    for p in prompts:
        ids = engine.encode(p)
        out.append((ids, engine.generate(ids, cfg).token_ids))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--calib-tokens", type=int, default=32)
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--min-count", type=int, default=2)
    ap.add_argument("--min-prob", default="0.05,0.1,0.2,0.3,0.5")
    ap.add_argument("--json", dest="json_out", type=Path, default=None)
    args = ap.parse_args()
    lm = load_model(args.model)
    engine = Engine(lm)
    probs = [float(x) for x in args.min_prob.split(",")]
    report = {}
    t0 = time.perf_counter()
    for f in args.files:
        prompts = [r["prompt"] for r in read_prompt_rows(f)]
        calib = continuations(engine, prompts[: args.calib], args.calib_tokens)
        held = continuations(engine, prompts[args.calib: args.calib + args.held_out], args.tokens)
        table = build_bigram_table([p + c for p, c in calib], args.min_count)
        rows = {"pld": statistical_acceptance(held, args.k, bigram=False)}
        for mp in probs:
            rows[f"bigram@{mp}"] = statistical_acceptance(held, args.k, min_prob=mp, table=table)
        report[f.stem] = {"table_entries": len(table), **{name: r.to_dict() for name, r in rows.items()}}
        print(f"{f.stem} (table {len(table)} entries, {time.perf_counter() - t0:.0f} s)")
        for name, r in rows.items():  # a StatisticalAcceptance record each
            print(f"  {name:12s} token acc {r.token_acceptance:.3f}  available {r.available:.2f}  "
                  f"accepted/step {r.accepted_per_step:.3f}  drafted/step {r.drafted_per_step:.2f}  "
                  f"by position {list(r.position_acceptance[:4])}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
