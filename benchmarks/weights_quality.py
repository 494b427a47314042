"""How far each weight mode is from the dense model, and from the GGUF file's own Q4_1 blocks.

For held-out Spec-Bench prompts (``--skip-first`` of each group, ``--per-group`` of them):

* the dense model (``--dtype``, default float32) decodes ``--new`` greedy tokens: the reference;
* for each mode (dense, int8, int4): the perplexity of that reference continuation under the mode
  (teacher-forced, one forward), and how many leading tokens its own greedy output shares with
  the reference (``agree``; ``identical``: prompts where all of them do);
* per mode, the weights themselves: the mean absolute difference between the rounded weights and
  the dense ones, and the share of weights left exactly as they were. The dense weights are the
  GGUF file's de-quantized Q4_1 blocks, so int4 in groups of 32 (the same block shape) can give
  them back exactly.

    python benchmarks/weights_quality.py ../shared/data/spec_bench_dev.jsonl --skip-first 16 --per-group 4
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from adaptive.bench.data import load_bench_prompts
from adaptive.bench.runner import common_prefix
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.quant import WEIGHT_MODES
from adaptive.models import load_model


def nll(bb, ids: list[int], start: int) -> tuple[float, int]:
    """Summed negative log-likelihood of ``ids[start:]`` given what precedes each, and the count."""
    cache = bb.new_cache(len(ids))
    logits = bb.forward(torch.tensor(ids), cache, 0, logits="all").logits  # [T, V]
    logp = torch.log_softmax(logits[start - 1:-1], dim=-1)
    target = torch.tensor(ids[start:])
    return float(-logp[torch.arange(len(target)), target].sum()), len(target)


def weight_drift(dense: dict[str, torch.Tensor], model) -> dict:
    """Mean |rounded - dense| and the share of weights unchanged, over the layers' linear weights."""
    diff, same, n = 0.0, 0, 0
    for name, w in model.named_parameters():
        if name in dense:
            d = (w.detach().float() - dense[name]).abs()
            diff += float(d.sum())
            same += int((d == 0).sum())
            n += d.numel()
    return {"mean_abs_diff": diff / n, "unchanged": same / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("--skip-first", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", dest="out", default=None, help="Also write the figures as JSON here.")
    args = ap.parse_args()
    prompts = load_bench_prompts(args.data, per_category=args.per_group, skip_first=args.skip_first)

    ref_lm = load_model("smollm2-135m", dtype=args.dtype)
    linear = {n: p.detach().float().clone() for n, p in ref_lm.model.named_parameters()
              if "proj" in n or "lm_head" in n or "embed" in n}
    eng = Engine(ref_lm)
    cfg = GenerationConfig(max_new_tokens=args.new)
    refs = []
    for p in prompts:
        ids = eng.encode([{"role": "user", "content": p.turns[0]}])
        refs.append((p.group, ids, eng.generate(ids, cfg).token_ids))
    del eng, ref_lm

    table = {}
    for mode in WEIGHT_MODES:
        lm = load_model("smollm2-135m", dtype=args.dtype, weights=mode)
        eng = Engine(lm)
        bb = lm.backbone  # rounds the weights
        total, count, agree, identical = 0.0, 0, [], 0
        for _, ids, ref in refs:
            s, c = nll(bb, ids + ref, len(ids))
            total, count = total + s, count + c
            out = eng.generate(ids, cfg).token_ids
            agree.append(common_prefix(ref, out))
            identical += out == ref
        table[mode] = {"perplexity": math.exp(total / count), "agree_tokens": sum(agree) / len(agree),
                       "identical": f"{identical}/{len(refs)}", **weight_drift(linear, lm.model)}
        print(mode, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in table[mode].items()}, flush=True)
        del eng, bb, lm
    print("\n| weights | perplexity of dense greedy text | leading tokens equal to dense (of "
          f"{args.new}) | identical outputs | mean abs weight change | weights unchanged |")
    print("|---|---|---|---|---|---|")
    for mode, r in table.items():
        print(f"| {mode} | {r['perplexity']:.3f} | {r['agree_tokens']:.1f} | {r['identical']} | "
              f"{r['mean_abs_diff']:.2e} | {100 * r['unchanged']:.1f}% |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"settings": vars(args), "prompts": len(refs), "modes": table}, f, indent=1)


if __name__ == "__main__":
    main()
