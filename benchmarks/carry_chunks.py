"""A prompt chunk carried by a decoding step's forward, against the two forwards apart.

Loads the model on ``--engine``, prefills ``--sequences`` decoding sequences to ``--context``
positions, then times, ``--repeats`` times per round: a ``--chunk``-token chunk of a new prompt
(at position 256) and one row of each decoding sequence in one ``forward_batch`` (the chunk a
``Segment(logits=False)``), the same two apart (the chunk's ``forward``, then the rows'
``forward_batch``), the chunk alone and the rows alone. What a backbone's ``carry_chunks`` rests on.

    python benchmarks/carry_chunks.py --engine llama.cpp
    python benchmarks/carry_chunks.py --engine torch --rounds 3
"""

from __future__ import annotations

import argparse
import time

import torch

from adaptive.engine.backbone import Segment
from adaptive.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--engine", default="llama.cpp")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    bb = load_model(args.model, engine=args.engine).backbone
    ids = [(7 * i + 3) % 1000 + 100 for i in range(args.context + 256 + args.chunk)]
    room = args.context + 256 + args.chunk + 8
    caches = [bb.new_cache(room) for _ in range(args.sequences)]
    for c in caches:
        bb.forward(torch.tensor(ids[:args.context]), c, 0, logits="none")
        c.length = args.context

    def timed(kind: str) -> float:
        total = 0.0
        for _ in range(args.repeats):
            pc = bb.new_cache(room)
            bb.forward(torch.tensor(ids[:256]), pc, 0, logits="none")
            rows = [Segment(torch.tensor([5]), c, args.context) for c in caches]
            chunk = Segment(torch.tensor(ids[256:256 + args.chunk]), pc, 256, logits=False)
            t0 = time.perf_counter()
            if kind == "together":
                bb.forward_batch(rows + [chunk])
            if kind in ("apart", "chunk"):
                bb.forward(chunk.ids, pc, 256, logits="none")
            if kind in ("apart", "rows"):
                bb.forward_batch(rows)
            total += time.perf_counter() - t0
            del pc
        return total / args.repeats * 1e3

    print(f"{args.model} on {args.engine}: a {args.chunk}-token chunk and {args.sequences} rows at "
          f"{args.context} positions (ms per forward pair, mean of {args.repeats})")
    for r in range(args.rounds):
        t = {k: timed(k) for k in ("together", "apart", "chunk", "rows")}
        print(f"round {r + 1}: together {t['together']:.1f}  apart {t['apart']:.1f}  chunk alone {t['chunk']:.1f}  "
              f"rows alone {t['rows']:.1f}  together/apart {t['together'] / t['apart']:.2f}", flush=True)


if __name__ == "__main__":
    main()
