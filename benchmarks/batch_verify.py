"""What batching buys: B sequences' verification forwards one after another vs one packed forward.

For each batch size B and tokens per sequence T (1: a plain step; k + 1: a verification of k
drafts), B sequences with their own caches (random prompts of ``--context`` tokens) are fed T
tokens each, either by B calls of :meth:`Backbone.forward` or by one :meth:`Backbone.forward_batch`
(the linear layers and the head multiply all B*T rows at once; attention per sequence). Prints the
median time of each and the ratio: the most a server that batches concurrent requests could gain
in aggregate throughput over decoding them one at a time. Interleaved, median of ``--repeats``.

    python benchmarks/batch_verify.py --model smollm2-135m --dtype bfloat16 --batch 1 2 4 8 --tokens 1 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaptive.engine.backbone import Segment
from adaptive.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    lm = load_model(args.model, dtype=args.dtype)
    bb = lm.backbone
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads, context {args.context}")
    print("  B   T   one at a time (ms)   batched (ms)   throughput gain")
    for T in args.tokens:
        for B in args.batch:
            caches = []
            for _ in range(B):
                c = bb.new_cache(args.context + T + 1)
                bb.forward(torch.randint(0, bb.vocab_size, (args.context,)), c, 0, logits="none")
                caches.append(c)
            feeds = [torch.randint(0, bb.vocab_size, (T,)) for _ in range(B)]
            seq, bat = [], []
            for r in range(args.repeats + 2):
                t0 = time.perf_counter()
                for f, c in zip(feeds, caches):
                    bb.forward(f, c, args.context, logits="all")
                t1 = time.perf_counter()
                bb.forward_batch([Segment(f, c, args.context) for f, c in zip(feeds, caches)])
                t2 = time.perf_counter()
                if r >= 2:  # warm-up
                    seq.append(t1 - t0)
                    bat.append(t2 - t1)
            s, b = statistics.median(seq) * 1e3, statistics.median(bat) * 1e3
            print(f"{B:3d} {T:3d} {s:20.1f} {b:14.1f} {s / b:17.2f}x")


if __name__ == "__main__":
    main()
