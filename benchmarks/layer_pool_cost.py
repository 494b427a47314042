"""What the routing embedding costs on the llama.cpp engine (issue 43): prefill and decoding steps.

    python benchmarks/layer_pool_cost.py [--model smollm2-135m] [--lengths 128,512] [--rounds 7]
    python benchmarks/layer_pool_cost.py --feature-layers 3,15,29


In each round, interleaved, for each prompt length: the prompt's prefill plain, with a layer's
pool (the residual stream after a third of the layers at the last position: llama.cpp copies
that layer's input rows out of the prefill's own graph), and with the final layer's last
position (the last token decoded again in a scratch sequence, the embedding before issue 43);
then 32 one-token decoding steps after the plain prefill and after the pooled one (the
layer-input copy is off again by then). Prints the median of each and the ratios to plain.
Random token ids, fixed seed; llama.cpp's threads as the engine's default.

``--feature-layers``: instead, what an eagle head on this engine would pay (issue 61): decoding steps
(one row) and verifications (``--verify-rows``, logits at every row) after each prompt, interleaved:
plain; with those layers' input rows read out of every forward as routing reads them (the layer-input
API asked for and released around each forward); and with it asked for once for the whole request,
each forward's raw rows copied out after it (what a head's runtime would do).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from adaptive.engine.config import Pooling
from adaptive.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--feature-layers", default=None, help="e.g. 3,15,29: the cost of reading them at every step")
    ap.add_argument("--verify-rows", type=int, default=3)
    args = ap.parse_args()
    bb = load_model(args.model, engine="llama.cpp").backbone
    if args.feature_layers:
        return feature_rows(bb, args)
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


def feature_rows(bb, args) -> None:
    """The ``--feature-layers`` measurement (see the module doc)."""
    layers = tuple(int(x) for x in args.feature_layers.split(","))
    R = args.verify_rows
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {}
    if not bb.layer_pools:
        raise SystemExit("this llama.cpp build gives no layer inputs for this model")
    (set_fn, get_fn), _ = bb._layers  # the layer-input calls the engine probed (benchmark only)

    def step(ids, cache, start, logits, taps, kept):
        if not kept:
            return bb.forward(ids, cache, start, logits=logits, pool_layers=taps)
        out = bb.forward(ids, cache, start, logits=logits)
        for layer in taps:  # the raw rows, copied out as a head would take them
            np.ctypeslib.as_array(get_fn(bb._ctx, layer), shape=(len(ids), bb.hidden_size)).copy()
        return out

    for r in range(args.rounds):
        for n in (int(v) for v in args.lengths.split(",")):
            ids = torch.randint(100, bb.vocab_size - 100, (n + args.steps * (R + 1),), generator=gen)
            order = [((), "plain"), (layers, "feature rows"), (layers, "feature rows kept on")]
            for taps, name in order[r % 3:] + order[:r % 3]:
                kept = name.endswith("kept on")
                cache = bb.new_cache(n + args.steps * (R + 1))
                bb.forward(ids[:n], cache, 0, logits="last")
                if kept:  # asked for once for the whole request (a head's runtime would), read after each forward
                    for layer in taps:
                        set_fn(bb._ctx, layer, True)
                t = time.perf_counter()
                for j in range(args.steps):
                    step(ids[n + j:n + j + 1], cache, n + j, "last", taps, kept)
                times.setdefault(f"step after {n}, {name}", []).append((time.perf_counter() - t) / args.steps)
                at = n + args.steps
                t = time.perf_counter()
                for j in range(args.steps):  # verifications of R rows, each kept (the next one starts after it)
                    step(ids[at + j * R:at + (j + 1) * R], cache, at + j * R, "all", taps, kept)
                times.setdefault(f"{R}-row verification after {n}, {name}", []).append(
                    (time.perf_counter() - t) / args.steps)
                if kept:
                    for layer in taps:
                        set_fn(bb._ctx, layer, False)
                del cache
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {"model": args.model, "threads": bb.threads, "rounds": args.rounds, "layers": list(layers), "ms": {}}
    for k, v in med.items():
        base = med[k.rsplit(", ", 1)[0] + ", plain"]
        out["ms"][k] = {"median": round(v, 3), "over plain": round(v / base, 4)}
        print(f"{k:<48} {v:9.3f} ms  {v / base:6.3f}x plain")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
