"""What the routing embedding costs on the llama.cpp engine (issue 43): prefill and decoding steps.

    python benchmarks/layer_pool_cost.py [--model smollm2-135m] [--lengths 128,512] [--rounds 7]

In each round, interleaved, for each prompt length: the prompt's prefill plain, with a layer's
pool (the residual stream after a third of the layers at the last position: llama.cpp copies
that layer's input rows out of the prefill's own graph), and with the final layer's last
position (the last token decoded again in a scratch sequence, the embedding before issue 43);
then 32 one-token decoding steps after the plain prefill and after the pooled one (the
layer-input copy is off again by then). Prints the median of each and the ratios to plain.
Random token ids, fixed seed; llama.cpp's threads as the engine's default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adaptive.engine.config import Pooling
from adaptive.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    bb = load_model(args.model, engine="llama.cpp").backbone
    layer = Pooling(max(1, round(bb.n_layers / 3)), "last")
    ways = {"plain": {}, "layer pool": bb.pool_args(layer), "final last (before)": bb.pool_args(Pooling(None, "last"))}
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for n in (int(v) for v in args.lengths.split(",")):
            ids = torch.randint(100, bb.vocab_size - 100, (n + args.steps,), generator=gen)
            caches = {}
            for name, extra in ways.items():
                cache = bb.new_cache(n + args.steps)
                t = time.perf_counter()
                bb.forward(ids[:n], cache, 0, logits="last", **extra)
                times.setdefault(f"prefill {n}, {name}", []).append(time.perf_counter() - t)
                caches[name] = cache
            for name in ("plain", "layer pool"):
                cache = caches[name]
                t = time.perf_counter()
                for j in range(args.steps):
                    bb.forward(ids[n + j:n + j + 1], cache, n + j, logits="last")
                times.setdefault(f"step after {n}, {name}", []).append((time.perf_counter() - t) / args.steps)
            del caches
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {"model": args.model, "threads": bb.threads, "rounds": args.rounds, "pooling": layer.to_dict(), "ms": {}}
    for k, v in med.items():
        base = med[k.rsplit(", ", 1)[0] + ", plain"]
        out["ms"][k] = {"median": round(v, 3), "over plain": round(v / base, 4)}
        print(f"{k:<40} {v:9.2f} ms  {v / base:6.3f}x plain")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
