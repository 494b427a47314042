"""Routing overhead per request: pooled tensor -> numpy, normalise, FAISS search, vote, decision.

    python benchmarks/routing_overhead.py [--anchors 10000] [--dim 576] [--requests 2000]

The embedding itself costs nothing extra: it is the mean of the prefill's final hidden states,
which the engine computes anyway (timed here too: the mean over a 300-token prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from adaptive.index.anchors import AnchorIndex
from adaptive.index.embedding import pooled_to_numpy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchors", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=576)  # SmolLM2-135M's hidden size
    ap.add_argument("--domains", type=int, default=50)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    anchors = rng.normal(size=(args.anchors, args.dim)).astype(np.float32)
    anchors /= np.linalg.norm(anchors, axis=1, keepdims=True)
    labels = [f"d{i % args.domains}" for i in range(args.anchors)]
    index = AnchorIndex(anchors, labels, np.zeros(args.dim, np.float32), ood_threshold=1.5, k=args.k)
    hidden = torch.randn(300, args.dim, dtype=torch.bfloat16)
    times, pool_times = [], []
    for i in range(args.requests + 50):
        t0 = time.perf_counter()
        pooled = hidden.float().mean(dim=0)  # what the prefill forward adds for pool=True
        t1 = time.perf_counter()
        index.route(pooled_to_numpy(pooled))
        t2 = time.perf_counter()
        if i >= 50:  # warm-up
            pool_times.append(t1 - t0)
            times.append(t2 - t1)
    out = {"anchors": args.anchors, "dim": args.dim, "k": args.k, "requests": args.requests,
           "threads": torch.get_num_threads(),
           "route_ms_median": round(statistics.median(times) * 1e3, 4),
           "route_ms_p99": round(sorted(times)[int(0.99 * len(times))] * 1e3, 4),
           "pool_ms_median": round(statistics.median(pool_times) * 1e3, 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
