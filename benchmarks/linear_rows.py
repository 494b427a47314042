"""How a linear layer's time grows with the rows it multiplies: what verifying k drafts costs.

A verification multiplies ``k + 1`` rows through every weight where a decoding step multiplies
one. If the weights dominate (memory-bound), that is nearly free; if the kernel's time grows with
the rows, drafting cannot pay. For each weight mode, the layers of one transformer block of the
model (plus its LM head) are timed at 1 .. 9 rows, as a ratio to one row (median of repeats, each
the mean of a few calls). Synthetic weights of the model's shapes: no model is loaded.

    python benchmarks/linear_rows.py qwen2.5-coder-1.5b bfloat16:dense float32:int8 float32:int4
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from adaptive.engine.quant import Linear

SHAPES = {  # (N, K) of qkv, o, gate+up, down and the head, as the engine fuses them
    "smollm2-135m": [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536), (49152, 576)],
    "qwen2.5-coder-1.5b": [(1536 + 2 * 256, 1536), (1536, 1536), (2 * 8960, 1536), (1536, 8960), (151936, 1536)],
}
ROWS = (1, 2, 3, 4, 5, 6, 9)


def time_rows(layers: list[Linear], k: int, dtype: torch.dtype, calls: int = 5, repeats: int = 7) -> float:
    xs = [torch.randn(k, lin.shape[1], dtype=dtype) for lin in layers]

    def once():
        for lin, x in zip(layers, xs):
            lin(x)

    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            once()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main() -> None:
    model, *modes = sys.argv[1:] or ["qwen2.5-coder-1.5b"]
    torch.manual_seed(0)
    for arg in modes or ["bfloat16:dense"]:
        dtype_name, mode = arg.split(":")
        dtype = getattr(torch, dtype_name)
        layers = [Linear.build(torch.randn(n, k, dtype=dtype) * 0.02, None, mode) for n, k in SHAPES[model]]
        one = time_rows(layers, 1, dtype)
        ratios = {k: time_rows(layers, k, dtype) / one for k in ROWS}
        print(f"{model} {arg}: 1 row {one * 1000:.2f} ms; " + ", ".join(f"{k}: {r:.2f}" for k, r in ratios.items()),
              flush=True)


if __name__ == "__main__":
    main()
