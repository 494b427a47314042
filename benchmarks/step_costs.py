"""Time the engine's forwards per weight mode: prefill, one decoding step, verifications.

For each (dtype, weights) given, on the embedded model with random token ids: a 40- and a
600-token prefill, a one-token step and 5- and 9-token verifications at a context of 600
(milliseconds, mean of a few calls after one unmeasured call). Run it alone: 2 cores are easily
disturbed.

    python benchmarks/step_costs.py float32:dense bfloat16:dense float32:int8 float32:int4
"""

from __future__ import annotations

import sys
import time

import torch

from adaptive.models import load_model


def timed(f, n: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1000


def costs(bb) -> dict[str, float]:
    cache = bb.new_cache(1200)
    ids = torch.randint(0, 40000, (1100,), generator=torch.Generator().manual_seed(0))
    return {
        "prefill40": timed(lambda: bb.forward(ids[:40], cache, 0), 2),
        "prefill600": timed(lambda: bb.forward(ids[:600], cache, 0), 1),
        "step": timed(lambda: bb.forward(ids[:1], cache, 600), 10),
        "verify5": timed(lambda: bb.forward(ids[:5], cache, 600, logits="all"), 10),
        "verify9": timed(lambda: bb.forward(ids[:9], cache, 600, logits="all"), 5),
    }


def main() -> None:
    for arg in sys.argv[1:] or ["float32:dense", "float32:int8", "float32:int4"]:
        dtype, weights = arg.split(":")
        row = costs(load_model("smollm2-135m", dtype=dtype, weights=weights).backbone)
        print(f"{dtype} {weights}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
