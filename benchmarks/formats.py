"""The physical table: prefill and decode rates of each weight format on this CPU (docs/design.md,
"Prefill on the fastest weights").

For llama.cpp, every format is derived from the model's GGUF by llama.cpp's quantizer
(:func:`adaptive.engine.prefill_file.derive`, cached) and timed by ``llama-bench`` (built by
``benchmarks/build_llama_server.sh``): ``pp`` tokens of prompt, ``tg`` of generation, ``-r`` repeats, with
its repacked weight layouts on and off. For the torch engine, the model's packed bf16 backbone: the median
prefill of ``pp`` tokens and of a one-token step after it (the calibration's own timers). Also the hybrid's
handover (:mod:`adaptive.engine.llamacpp_hybrid`): milliseconds per 1,000 positions of KV.

    python benchmarks/formats.py                               # the embedded model
    python benchmarks/formats.py --model qwen2.5-coder-1.5b --formats native,q4_0,q8_0,bf16 --repeats 2
    python benchmarks/formats.py --agreement ../shared/data/spec_bench_dev.jsonl --skip-first 16 --per-category 4

``--agreement FILE``: also how far the hybrid's plain greedy decoding (BF16 prefill, the GGUF's own decode)
parts from pure decoding on the GGUF file: per Spec-Bench group, the tokens of ``--max-new-tokens`` that
agree before the first difference, and those equal position by position.

Writes JSON (``--out``) and prints a Markdown table. Run it alone: every figure is a rate on shared cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from adaptive.bench.llama_server import find_server
from adaptive.engine.prefill_file import derive, file_type
from adaptive.models import gguf_of, load_model
from adaptive.workdir import cpu_name

NATIVE = "native"  # the model's own file


def llama_bench(binary: Path, gguf: Path, threads: int, pp: int, tg: int, repeats: int, repack: int) -> dict:
    """``{"pp": tok/s, "tg": tok/s}`` of llama-bench on ``gguf``."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(pp), "-n", str(tg), "-r", str(repeats),
           "--repack", str(repack), "-o", "json"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    out = {}
    for r in rows:
        out["pp" if r["n_prompt"] else "tg"] = round(float(r["avg_ts"]), 1)
    return out


def torch_rates(spec: str, pp: int, repeats: int) -> dict:
    """The torch engine's packed bf16 backbone: prefill of ``pp`` tokens and one decoding step, as tok/s."""
    import torch

    from adaptive.costs import measure_prefill
    from adaptive.resources import release_threads

    lm = load_model(spec, engine="torch", dtype="bfloat16", weights="auto")
    bb = lm.backbone
    release_threads()
    (n, ms), = measure_prefill(bb, lengths=(pp,), repeats=repeats)
    ids = torch.randint(0, bb.vocab_size, (pp + 70,), generator=torch.Generator().manual_seed(0))
    cache = bb.new_cache(pp + 70)
    bb.forward(ids[:pp], cache, 0, logits="last")
    times = []
    for i in range(64):
        t = time.perf_counter()
        bb.forward(ids[pp + i:pp + i + 1], cache, pp + i, logits="last")
        times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    return {"pp": round(n / (ms / 1e3), 1), "tg": round(1 / step, 1), "weights": lm.weights}


def handover_ms_per_1000(decode: Path, prefill: Path, threads: int, tokens: int = 1000) -> float:
    """Milliseconds to hand ``tokens`` positions of KV from a context over ``prefill`` to one over ``decode``."""
    from adaptive.engine.llamacpp import LlamaCppBackbone
    from adaptive.engine.llamacpp_host import load_seq_state, seq_state

    bb = LlamaCppBackbone(decode, threads=threads, context=tokens + 64, sequences=2, prefill=prefill)
    other = bb.hybrid.prefill
    cache = other.new_cache(tokens + 8)
    other.forward(list(range(100, 100 + tokens)), cache, 0, logits="none")
    target = bb.new_cache(tokens + 8)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        load_seq_state(bb.lib, bb.ctx, seq_state(other.lib, other.ctx, cache.seq), target.seq)
        times.append(time.perf_counter() - t)
    return round(sorted(times)[3] * 1e3 * 1000 / tokens, 2)


def agreement(spec: str, data: str, skip_first: int, per_category: int, max_new_tokens: int) -> dict:
    """Per group: ``{"prompts", "tokens", "prefix", "same"}``: the hybrid's greedy tokens against pure decoding's."""
    from adaptive.bench.data import load_bench_prompts
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    pure = Engine(load_model(spec, engine="llama.cpp", prefill="off"))
    hybrid = Engine(load_model(spec, engine="llama.cpp", prefill="bf16"))
    out: dict[str, dict] = {}
    for p in load_bench_prompts(data, per_category, skip_first=skip_first):
        a = pure.generate(p.turns[0], cfg).token_ids
        b = hybrid.generate(p.turns[0], cfg).token_ids
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        g = out.setdefault(p.group, {"prompts": 0, "tokens": 0, "prefix": 0, "same": 0})
        g["prompts"] += 1
        g["tokens"] += len(a)
        g["prefix"] += prefix
        g["same"] += sum(x == y for x, y in zip(a, b))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a model spec (its GGUF file is the native format)")
    ap.add_argument("--formats", default="native,q4_0,q8_0,f16,bf16",
                    help="comma-separated: native (the model's own file) and kinds derived from it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="leave the torch engine out")
    ap.add_argument("--agreement", metavar="FILE", default=None, help="Spec-Bench-format prompts: the hybrid's "
                    "greedy tokens against pure decoding's")
    ap.add_argument("--skip-first", type=int, default=16)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-table", action="store_true", help="only the agreement")
    ap.add_argument("--out", default="formats.json")
    args = ap.parse_args(argv)
    source = gguf_of(args.model)
    if source is None:
        raise SystemExit(f"formats: {args.model} has no GGUF file")
    report = {"host": cpu_name(), "model": args.model, "threads": args.threads}
    if args.agreement:
        report["agreement"] = agreement(args.model, args.agreement, args.skip_first, args.per_category,
                                        args.max_new_tokens)
        print("| group | prompts | tokens agreeing before the first difference | tokens equal by position |\n"
              "|---|---|---|---|")
        for name, g in sorted(report["agreement"].items()):
            print(f"| {name} | {g['prompts']} | {g['prefix']}/{g['tokens']} | {g['same']}/{g['tokens']} |")
    if args.no_table:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        return
    binary = find_server().with_name("llama-bench")
    rows = []
    for fmt in args.formats.split(","):
        path = source if fmt == NATIVE else derive(source, fmt)
        for repack in (1, 0):
            r = llama_bench(binary, path, args.threads, args.pp, args.tg, args.repeats, repack)
            rows.append({"engine": "llama.cpp", "format": fmt if fmt != NATIVE else f"native (file type "
                         f"{file_type(source)})", "repack": bool(repack), "mib": round(path.stat().st_size / 2**20, 1),
                         **r})
            print(rows[-1], file=sys.stderr)
    if not args.no_torch:
        rows.append({"engine": "torch", "format": "bf16", "repack": None, **torch_rates(args.model, args.pp,
                                                                                      args.repeats)})
    handover = handover_ms_per_1000(source, derive(source, "bf16"), args.threads)
    report.update(pp=args.pp, tg=args.tg, repeats=args.repeats, rows=rows, handover_ms_per_1000_positions=handover)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"| engine | format | repack | MiB | pp{args.pp} tok/s | tg{args.tg} tok/s |\n|---|---|---|---|---|---|")
    for r in rows:
        repack = "" if r["repack"] is None else ("on" if r["repack"] else "off")
        print(f"| {r['engine']} | {r['format']} | {repack} | {r.get('mib', '')} | {r['pp']:,} | {r['tg']:,} |")
    print(f"\nhandover: {handover} ms per 1,000 positions ({cpu_name()}, {args.threads} threads)")


if __name__ == "__main__":
    main()
