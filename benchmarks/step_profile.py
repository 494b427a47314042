"""Where one decoding step's time goes: a torch.profiler table of 10 one-token steps.

The embedded model, a 600-token context of random ids, after warm-up; ``--weights`` and
``--dtype`` as for ``adaptive decode``. Run it on two commits to compare engines (before/after).

    python benchmarks/step_profile.py --dtype float32 --weights int4
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from adaptive.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="dense")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    kw = {} if args.weights == "dense" else {"weights": args.weights}  # an engine without the option: dense
    lm = load_model("smollm2-135m", dtype=args.dtype, **kw)
    bb = lm.backbone
    cache = bb.new_cache(args.context + 64)
    ids = torch.randint(0, 40000, (args.context + 1,), generator=torch.Generator().manual_seed(0))
    bb.forward(ids[:args.context], cache, 0)
    one = ids[args.context:]
    for _ in range(5):
        bb.forward(one, cache, args.context)
    start = time.perf_counter()
    for _ in range(20):
        bb.forward(one, cache, args.context)
    print(f"{args.dtype} {args.weights}: {(time.perf_counter() - start) / 20 * 1000:.1f} ms per step "
          f"at a context of {args.context}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            bb.forward(one, cache, args.context)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
