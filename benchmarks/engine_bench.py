"""Engine benchmark (not a test): our ar loop against HF generate, and ssd with a fixed skip set.

Over Spec-Bench-format prompts, 2 per group by default (mt_bench = the 8 MT-bench categories,
translation, summarization, qa, math_reasoning, rag), greedy, the same chat template and
max_new_tokens for all. Methods run interleaved prompt by prompt after a warm-up; the report gives
per group mean tokens/s, speedup over ar (Spec-Bench's definition), acceptance, mean accepted
tokens, equality with ar and the divergence audit.

    python benchmarks/engine_bench.py --data ../shared/data/spec_bench_dev.jsonl --skip 'attn=4,7,9,20,25' \
        --draft-lens 2,4 --out out/engine_bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import defaultdict
from pathlib import Path

import torch

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.audit import audit_divergence
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.engine.skip import SkipSet
from adaptive.models import load_model

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def load_prompts(path: Path, per_group: int) -> list[tuple[str, str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        g = "mt_bench" if row["category"] in MT_BENCH else row["category"]
        if len(groups[g]) < per_group:
            groups[g].append(row["turns"][0])
    return [(g, p) for g, ps in groups.items() for p in ps]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="../shared/data/spec_bench_dev.jsonl")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--skip", default="attn=4,7,9,20,25")
    ap.add_argument("--draft-lens", default="2,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    lm = load_model(args.model, dtype=args.dtype, engine="torch")  # ssd and hf: the torch engine
    eng = Engine(lm)
    skip = SkipSet.from_text(args.skip, lm.n_layers)
    prompts = load_prompts(Path(args.data), args.per_group)
    ks = [int(k) for k in args.draft_lens.split(",")]
    cfgs = {"ar": GenerationConfig(max_new_tokens=args.max_new_tokens)}
    for k in ks:
        cfgs[f"ssd-k{k}"] = GenerationConfig(max_new_tokens=args.max_new_tokens, draft_len=k)
    ssd = build_drafter(DrafterSpec("ssd", skip=skip), lm.backbone)  # keeps no state between requests
    eng.generate(prompts[0][1], GenerationConfig(max_new_tokens=16))  # warm-up
    eng.generate(prompts[0][1], cfgs[f"ssd-k{ks[0]}"], drafter=ssd)

    rows = []
    for group, prompt in prompts:
        ids = eng.encode(prompt)
        row = {"group": group, "prompt_tokens": len(ids)}
        t = time.perf_counter()
        hf = lm.model.generate(torch.tensor([ids], device=lm.device), do_sample=False,
                               max_new_tokens=args.max_new_tokens)[0, len(ids):].tolist()
        row["hf"] = {"tokens_per_s": len(hf) / (time.perf_counter() - t)}
        ar = None
        for name, cfg in cfgs.items():
            r = eng.generate(ids, cfg, drafter=None if name == "ar" else ssd)
            s = r.stats
            row[name] = {"tokens_per_s": s.tokens_per_s, "acceptance_rate": s.acceptance_rate,
                         "mean_accepted_tokens": s.mean_accepted_tokens}
            if name == "ar":
                ar = r.token_ids
                row["hf"]["identical_to_ar"] = hf[: len(ar)] == ar
            else:
                a = audit_divergence(lm.backbone, ids, ar, r.token_ids)
                row[name]["identical_to_ar"] = a.identical
                row[name]["violation"] = a.violation
                row[name]["margin"] = a.margin
        rows.append(row)
        print(json.dumps(row), flush=True)

    methods = ["hf", *cfgs]
    summary = {}
    for scope in ["overall"] + sorted({r["group"] for r in rows}):
        sel = [r for r in rows if scope == "overall" or r["group"] == scope]
        ar_mean = sum(r["ar"]["tokens_per_s"] for r in sel) / len(sel)
        summary[scope] = {}
        for m in methods:
            tps = sum(r[m]["tokens_per_s"] for r in sel) / len(sel)
            entry = {"tokens_per_s": round(tps, 2), "speedup": round(tps / ar_mean, 3),
                     "identical_to_ar": all(r[m].get("identical_to_ar", True) for r in sel)}
            if m.startswith("ssd"):
                entry["acceptance_rate"] = round(sum(r[m]["acceptance_rate"] for r in sel) / len(sel), 3)
                entry["mean_accepted_tokens"] = round(sum(r[m]["mean_accepted_tokens"] for r in sel) / len(sel), 3)
                entry["lossless_violations"] = sum(bool(r[m]["violation"]) for r in sel)
            summary[scope][m] = entry
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "device": str(lm.device)},
              "model": lm.name, "dtype": str(lm.dtype), "skip": skip.to_text(),
              "max_new_tokens": args.max_new_tokens, "summary": summary, "rows": rows}
    print("\n| group | " + " | ".join(f"{m} tok/s (x ar)" for m in methods) + " | ssd acceptance / tokens per step |")
    print("|---" * (len(methods) + 2) + "|")
    for scope, s in summary.items():
        cells = [f"{s[m]['tokens_per_s']:.1f} ({s[m]['speedup']:.2f})" for m in methods]
        acc = ", ".join(f"k{m[5:]}: {s[m]['acceptance_rate']:.2f} / {s[m]['mean_accepted_tokens']:.2f}"
                        for m in methods if m.startswith("ssd"))
        print(f"| {scope} | " + " | ".join(cells) + f" | {acc} |")
    viol = {m: summary["overall"][m]["lossless_violations"] for m in methods if m.startswith("ssd")}
    print(f"\nlossless violations: {viol}; hf identical to ar: {summary['overall']['hf']['identical_to_ar']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
