"""The device check's measurements (issue 42), run by ``benchmarks/device_check.sh``; one table at the end.

Parts (``--parts``, comma-separated; all by default):

* ``shapes``: random-weight models built from a config on the device (no download): the embedded
  model's shape (SmolLM2-135M), Qwen2.5-1.5B's and Llama-3-8B's (``--quick``: two tiny ones). For
  each: the plain step (one token after ``--context`` cached positions) in ms, eager and replayed as a
  CUDA graph (of plain kernels and of the default compiled pieces, with the seconds the first
  step took: compiling and capturing) and plain decoding through the loop; the bytes it reads
  (every weight once, the LM head included, and the keys and values of the context) over its time
  as a share of the device's bandwidth, measured in the same run by a large device-to-device copy;
  and the verification table, a forward over ``k + 1`` tokens for ``k = 1 .. 16`` drafts, in units
  of the plain step; and the verify table by batch size (issue 64): a server's batched step of 1, 8,
  32 and 64 requests (``--quick``: 1 and 2) feeding 1, 2, 4 or 8 rows each, in plain steps of one
  request (on CUDA its captured graphs as ``adaptive serve`` warms and times them).
* ``compile``: the embedded model's shape with torch.compile'd (Inductor) steps captured instead of
  eager ones: compile seconds and step ms (an experiment: is compiling worth its minutes?).
* ``kernels``: where the plain step's time goes, per shape of ``--shapes`` (default the embedded
  model's): the default captured step profiled over 20 replays (torch.profiler): kernels a step, their
  summed device time against the step's wall time (the rest is the gaps between kernels), and the
  kernels that take the most time.
* ``embedded``: the embedded model in bf16: a profile calibrated on this device (``--quick``), then
  ``adaptive bench`` (batch 1, 64 new tokens, ``--per-category`` prompts of each group of ``--data``
  after the first ``--skip-first`` (16), which calibration may use) with ``ar``, the routed runtime
  (``knn-ssd``), ``pld``, ``hf``, ``hf-static`` and ``hf-pld``, interleaved; then in fp32
  (``--fp32-methods``, ``--fp32-per-category`` prompts) for token equality with ``ar``; and each
  domain's speedups as its race measured them on the calibration prompts beside the bench's.
* ``heads`` (issue 61): an eagle head trained on this device for ``--head-minutes`` (default 5) on
  every group's prompts but the benchmark's (``benchmarks/specbench_domains.py --exclude``), into the
  profile of part ``embedded`` (calibrated here if that part did not run): its first draft kept, tau and
  the training's seconds, then ``adaptive bench`` in bf16 with ``ar``, the routed runtime, the head
  drafting trees (``eagle``) and chains (``eagle-chain``) and ``pld``, interleaved, the target's steps
  replayed as CUDA graphs that write the head's feature rows and verify its trees; and the same in
  fp32 for ``ar`` and the head, for token equality.
* ``serving`` (issue 64): ``adaptive serve`` on the embedded model in bf16 with the profile of part
  ``embedded`` (calibrated here if that part did not run), ``--max-batch`` the most clients, loaded
  by ``benchmarks/serve_load.py`` with 1, 8, 32 and 64 streaming greedy clients (``--quick``: 1 and
  2) over the held-out prompts, 64 new tokens (quick: 8), speculation on (``auto``) and off, in
  turn: aggregate tok/s, time to first token and inter-token latency (median, p90), errors; whether
  the server's batch ran batched graphs (its caches in slabs); then the peer, transformers' batched
  ``generate`` with the static cache at the same batch sizes (the same prompts, left-padded, every
  row decoding all its new tokens).

Writes ``--out``/device_check.json and prints the table (Markdown).

    python benchmarks/device_check.py --device cuda --data ../shared/data/spec_bench_dev.jsonl --out /tmp/dc
    python benchmarks/device_check.py --device cpu --quick --parts shapes --out /tmp/dc
    python benchmarks/device_check.py --device cuda --parts serving --out /tmp/dc
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# name -> (family, config fields): the shapes of part (b), random weights
SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)),
}
QUICK_SHAPES = {
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
                                 tie_word_embeddings=False)),
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=1024,
                                 tie_word_embeddings=True)),
}
EMBEDDED_METHODS = ("ar", "knn-ssd", "pld", "hf", "hf-static", "hf-pld")
SERVE_CLIENTS, QUICK_SERVE_CLIENTS = (1, 8, 32, 64), (1, 2)  # part serving's client counts
BATCHES, QUICK_BATCHES = (1, 8, 32, 64), (1, 2)  # the verify table by batch size (part shapes)
MAX_DRAFTS = 16
HEAD_METHODS = ("ar", "knn-ssd", "eagle", "eagle-chain", "pld")  # part heads' bf16 bench
PROFILED = {"knn-ssd", "eagle", "eagle-chain"}  # bench methods that read the profile (--profile)


def log(msg: str) -> None:
    print(f"[device_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeats: int, blocks: int = 5) -> float:
    """Median over ``blocks`` of the mean seconds of ``repeats`` calls of ``fn``."""
    out = []
    for _ in range(blocks):
        sync(dev)
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync(dev)
        out.append((time.perf_counter() - t) / repeats)
    return statistics.median(out)


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (bytes read plus written)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    return 2 * nbytes / timed(lambda: b.copy_(a), dev, repeats=5)


def build_random(family: str, fields: dict, dev: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **fields)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def random_ids(bb, n: int) -> torch.Tensor:
    """``n`` token ids drawn with a fixed seed (the same prompt for every run of a shape)."""
    return torch.randint(0, bb.vocab_size, (n,), generator=torch.Generator().manual_seed(0))


def prefilled(bb, ids: torch.Tensor, context: int, capacity: int):
    """A new cache of ``capacity`` positions holding the first ``context`` of ``ids``, prefilled."""
    cache = bb.new_cache(capacity)
    bb.forward(ids[:context].to(bb.device), cache, 0, logits="none")
    cache.length = context
    return cache


def weight_bytes(bb) -> int:
    """Bytes one step reads of the weights: every decoder layer's, the final norm and the LM head."""
    total = sum(t.numel() * t.element_size() for t in bb.model.model.layers.parameters())
    return total + bb.lm_head.weight.numel() * bb.lm_head.weight.element_size()


def measure_shape(name: str, family: str, fields: dict, dev: torch.device, dtype: torch.dtype, context: int,
                  repeats: int, bandwidth: float | None, batches: tuple[int, ...] = ()) -> dict:
    """One shape's row: the plain step eager and replayed (plain kernels, then the default compiled pieces,
    with the seconds its first step took: compiling and capturing), its share of ``bandwidth``, the
    verification table and plain decoding through the loop (tokens/s, the host's work included)."""
    from adaptive.engine.backbone import Backbone
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.graphs import StepGraphs
    from adaptive.engine.loop import decode_steps, new_cache, prefill
    from adaptive.engine.protocol import DecodeState

    t0 = time.perf_counter()
    model = build_random(family, fields, dev, dtype)
    bb = Backbone(model)
    ids = random_ids(bb, context + MAX_DRAFTS + 1)
    cache = prefilled(bb, ids, context, len(ids))
    kv_bytes = 2 * bb.n_layers * bb.n_kv_heads * bb.head_dim * context * cache.k.element_size()
    row = {"shape": name, "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
           "weight_MB": round(weight_bytes(bb) / 1e6, 1), "kv_MB": round(kv_bytes / 1e6, 2), "context": context}

    def step(n=1):
        return bb.forward(ids[context:context + n], cache, context, logits="all")

    if bb.graphs is not None:
        bb.graphs.enabled = False  # eager first: the same forward without graphs
        row["eager_ms"] = round(1e3 * timed(step, dev, max(3, repeats // 10)), 3)
        # plain kernels captured, then the default (compiled pieces), which the rest of the row measures
        for mode in ("none", "ops"):
            bb.graphs = StepGraphs(bb, compile=mode)
            cache = prefilled(bb, ids, context, len(ids))
            t = time.perf_counter()
            step()
            sync(dev)
            row[f"first_{mode}_s"] = round(time.perf_counter() - t, 2)
            row[f"graph_{mode}_ms"] = round(1e3 * timed(step, dev, repeats), 3)
        row["compile"] = bb.graphs.compile  # "none" if compiling the pieces failed
    plain = timed(step, dev, repeats)
    row["step_ms"] = round(1e3 * plain, 3)
    if bandwidth:
        row["hbm_share"] = round((weight_bytes(bb) + kv_bytes) / plain / bandwidth, 3)
    verify = []
    for k in range(1, MAX_DRAFTS + 1):
        step(k + 1)
        verify.append(round(timed(lambda k=k: step(k + 1), dev, max(5, repeats // 4)) / plain, 3))
    row["verify"] = verify  # verify[k - 1]: k drafts
    cfg = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    prompt = ids[:context].tolist()

    def decode(chain: int = 0):
        """Tokens/s and tokens of plain decoding after the prompt's prefill: through the loop (chains of 8 on CUDA),
        or (``chain``) by :meth:`Backbone.decode_chain`, reading the tokens every ``chain`` steps."""
        c = new_cache(bb, len(prompt), cfg)
        first = prefill(bb, prompt, c, cfg, None).first
        sync(dev)
        t = time.perf_counter()
        if not chain:
            toks = [tok for new in decode_steps(bb, DecodeState(bb, c, prompt + [first], cfg, None)) for tok in new]
        else:
            toks, last = [], first
            while len(toks) < cfg.max_new_tokens - 1:  # the prefill gave the first of them
                n = min(chain, cfg.max_new_tokens - 1 - len(toks))
                got = bb.decode_chain(last, c, len(prompt) + len(toks), n)
                if got is None:  # graphs turned off by a failed capture
                    raise RuntimeError("the chained step could not be captured")
                toks += got
                last = toks[-1]
        sync(dev)
        return len(toks) / (time.perf_counter() - t), toks

    _, plain_tokens = decode()
    row["loop_tok_s"] = round(statistics.median(decode()[0] for _ in range(3)), 1)
    if bb.graphs is not None:  # plain decoding chained on the device: one host read every 8 or 63 steps
        try:  # a measurement beside the row's: its failure loses only itself
            for chain in (8, 63):
                _, toks = decode(chain)  # captures the chained step (not timed)
                row[f"chain{chain}_tok_s"] = round(statistics.median(decode(chain)[0] for _ in range(3)), 1)
                row[f"chain{chain}_same"] = toks == plain_tokens
        except Exception as exc:  # noqa: BLE001 - reported in the row
            row["chain_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if batches:
        try:  # beside the row too
            row["batch_verify"] = batch_table(bb, dev, batches, context, max(5, repeats // 4))
        except Exception as exc:  # noqa: BLE001 - reported in the row
            row["batch_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if bb.graphs is not None:
        row["captures"] = bb.graphs.captures
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def batch_table(bb, dev: torch.device, batches: tuple[int, ...], context: int, repeats: int) -> dict:
    """The verify table by batch size (issue 64): ``{B: [cost of a batched step feeding R = 1, 2, 4, 8 rows
    a request]}`` in plain steps of one request, attending the smallest span. On CUDA the server's own
    batched graphs, captured and timed as it warms them (:meth:`StepGraphs.warm_batches`); elsewhere the
    same static step run eagerly."""
    from adaptive.engine.batched import MIN_SPAN, ROW_BUCKETS, BatchedStep, Slab, batch_bucket

    if bb.graphs is not None:
        bb.reserve_batch(max(batches))
        bb.graphs.warm_batches(max(batches), bb._full, context, repeats)
        secs = bb.graphs.batch_seconds
        return {str(b): [round(secs[batch_bucket(b)][r] / secs[1][1], 3) for r in ROW_BUCKETS] for b in batches}
    slab = Slab(bb.allocate_kv, max(batches), capacity=2 * MIN_SPAN)
    cos, sin = bb.rope_table(slab.capacity)
    times = {}
    with torch.inference_mode():
        for b in sorted({1, *batches}):
            for r in ROW_BUCKETS:
                step = BatchedStep(bb, b, r, MIN_SPAN, bb._full)
                ids = torch.zeros(b, r, dtype=torch.long, device=dev)
                slots = torch.arange(b, device=dev) % slab.slots
                starts = torch.full((b,), MIN_SPAN - ROW_BUCKETS[-1], dtype=torch.long, device=dev)
                args = (ids, slots, starts, slab.k, slab.v, cos, sin)
                times[b, r] = timed(lambda step=step, args=args: step(*args), dev, repeats)
    return {str(b): [round(times[b, r] / times[1, 1], 3) for r in ROW_BUCKETS] for b in batches}


def compile_experiment(dev: torch.device, dtype: torch.dtype, context: int, repeats: int) -> dict:
    """The embedded model's shape with compiled (Inductor) steps captured instead of eager ones: plain and
    8-draft verification ms, and the compile time of the two."""
    from adaptive.engine.backbone import Backbone

    family, fields = SHAPES["smollm2-135m"]
    bb = Backbone(build_random(family, fields, dev, dtype))
    if bb.graphs is None:
        return {"skipped": "no CUDA graphs on this device"}
    bb.graphs.compile = "step"
    ids = torch.randint(0, bb.vocab_size, (context + 10,), generator=torch.Generator().manual_seed(0))
    cache = bb.new_cache(context + 10)
    bb.forward(ids[:context].to(dev), cache, 0, logits="none")
    out = {}
    for n in (1, 9):
        t = time.perf_counter()
        bb.forward(ids[context:context + n], cache, context, logits="all")
        sync(dev)
        out[f"T{n}_compile_s"] = round(time.perf_counter() - t, 1)
        log(f"compiled the {n}-token step in {out[f'T{n}_compile_s']} s")
    for n in (1, 9):
        out[f"T{n}_ms"] = round(1e3 * timed(lambda n=n: bb.forward(ids[context:context + n], cache, context,
                                                                   logits="all"), dev, repeats), 3)
    out["enabled"] = bb.graphs.enabled
    return out


def part_shapes(args, dev: torch.device) -> dict:
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    bw = copy_bandwidth(dev, (64 << 20) if args.quick else (2 << 30))
    log(f"device copy: {bw / 1e9:.0f} GB/s (read + written)")
    rows = []
    shapes = QUICK_SHAPES if args.quick else SHAPES
    for name, (family, fields) in shapes.items():
        if args.shapes and name not in args.shapes.split(","):
            continue
        try:
            rows.append(measure_shape(name, family, fields, dev, dtype, args.context, args.repeats, bw,
                                      batches=QUICK_BATCHES if args.quick else BATCHES))
            log(f"shape {name}: {rows[-1]}")
            gc.collect()  # the backbone and its graphs hold each other: free the model before the next
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - a failed shape is a row of the table, not the end of the check
            rows.append({"shape": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            log(f"shape {name} failed: {rows[-1]['error']}")
    return {"bandwidth_GBps": round(bw / 1e9, 1), "dtype": str(dtype).replace("torch.", ""), "rows": rows}


def profile_step(name: str, family: str, fields: dict, dev: torch.device, dtype: torch.dtype, context: int,
                 steps: int = 20) -> dict:
    """The default plain step of one shape (captured where CUDA graphs are on) under torch.profiler:
    kernels (device events on CUDA, operators on the CPU) a step, their summed time a step against the
    step's wall time, and the ten that take the most time."""
    from torch.profiler import ProfilerActivity, profile

    from adaptive.engine.backbone import Backbone

    bb = Backbone(build_random(family, fields, dev, dtype))
    ids = random_ids(bb, context + 1)
    cache = prefilled(bb, ids, context, len(ids))

    def step():
        return bb.forward(ids[context:context + 1], cache, context, logits="all")

    for _ in range(3):  # compile and capture outside the profile
        step()
    wall = timed(step, dev, 50)
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync(dev)

    def self_us(e) -> float:  # the profiler's name for device time changed across torch versions
        if cuda:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    events = [e for e in prof.key_averages() if self_us(e) > 0]
    if cuda:
        events = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    busy_ms = sum(self_us(e) for e in events) / 1e3 / steps
    top = sorted(events, key=self_us, reverse=True)[:10]
    return {"shape": name, "graphs": bb.graphs is not None and bb.graphs.enabled,
            "step_ms": round(1e3 * wall, 3), "kernels_per_step": round(sum(e.count for e in events) / steps, 1),
            "busy_ms": round(busy_ms, 3), "busy_share": round(busy_ms / (1e3 * wall), 3),
            "top": [{"name": e.key[:80], "per_step": round(e.count / steps, 1),
                     "us_per_step": round(self_us(e) / steps, 1)} for e in top]}


def part_kernels(args, dev: torch.device) -> dict:
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    shapes = QUICK_SHAPES if args.quick else SHAPES
    names = args.shapes.split(",") if args.shapes else [next(iter(shapes))]
    rows = []
    for name in names:
        try:
            rows.append(profile_step(name, *shapes[name], dev, dtype, args.context))
        except Exception as exc:  # noqa: BLE001 - a failed shape is a row, not the end of the check
            rows.append({"shape": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        log(f"kernels {name}: {rows[-1]}")
        gc.collect()
    return {"rows": rows}


def part_compile(args, dev: torch.device) -> dict:
    try:
        out = compile_experiment(dev, torch.float32 if dev.type == "cpu" else torch.bfloat16, args.context,
                                 args.repeats)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        out = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    log(f"compiled steps: {out}")
    return out


def run(cmd: list[str], timeout: float, log_path: Path) -> dict:
    """Run a command (the CLI), its output to ``log_path``: ``{"ok", "seconds", "tail"}``."""
    t = time.perf_counter()
    log(" ".join(cmd))
    with open(log_path, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    return {"ok": rc == 0, "rc": rc, "seconds": round(time.perf_counter() - t, 1), "tail": tail}


CLI = [sys.executable, "-m", "adaptive.cli.main"]


def calibrated(args, dev: torch.device, out_dir: Path) -> dict:
    """Calibrate the embedded model in bf16 on ``--data``'s groups into ``out_dir``/profile (resumed: a
    second call after a finished one costs nothing); :func:`run`'s result."""
    domains = out_dir / "domains"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "specbench_domains.py"), args.data, str(domains)],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    cal = [*CLI, "calibrate", "--model", args.model, "--engine", "torch", "--device", dev.type, "--dtype", "bfloat16",
           *(["--quick"] if args.calibration == "quick" else []), "--out", str(out_dir / "profile"), "--resume"]
    for f in sorted(domains.glob("*.jsonl")):
        cal += ["--domains", f"{f.stem}={f}"]
    return run(cal, args.calibrate_timeout, out_dir / "calibrate.log")


def benches(args, dev: torch.device, out_dir: Path, prefix: str, bf16: list[str], fp32: list[str],
            profile: Path) -> dict:
    """``adaptive bench`` of the embedded model in bf16 (``bf16``'s methods, ``--per-category`` prompts) and in
    fp32 (``fp32``'s, ``--fp32-per-category``), with ``profile`` where a method reads it (:data:`PROFILED`):
    ``{"bench_bfloat16": ..., "bench_float32": ...}``, each :func:`run`'s result with the report's ``results``
    and ``runs``."""
    res: dict = {}
    for dtype, names, per, limit in (("bfloat16", bf16, args.per_category, args.bench_timeout),
                                     ("float32", fp32, args.fp32_per_category, args.fp32_timeout)):
        report = out_dir / f"{prefix}bench-{dtype}.json"
        cmd = [*CLI, "bench", "--model", args.model, "--engine", "torch", "--device", dev.type, "--dtype", dtype,
               "--data", args.data, "--skip-first", str(args.skip_first), "--per-category", str(per),
               "--max-new-tokens", "64", "--methods", ",".join(names), "--out", str(report), "--quiet"]
        if set(names) & PROFILED:
            cmd += ["--profile", str(profile)]
        res[f"bench_{dtype}"] = run(cmd, limit, out_dir / f"{prefix}bench-{dtype}.log")
        if report.exists():
            data = json.loads(report.read_text())
            res[f"bench_{dtype}"]["report"] = data["results"]
            res[f"bench_{dtype}"]["runs"] = data["runs"]
    return res


def part_embedded(args, dev: torch.device, out_dir: Path) -> dict:
    profile = out_dir / "profile"
    res: dict = {}
    res["calibrate"] = calibrated(args, dev, out_dir)
    if res["calibrate"]["ok"]:
        res["raced"] = raced(profile)
    methods = [m for m in args.methods.split(",") if res["calibrate"]["ok"] or m != "knn-ssd"]
    fp32 = [m for m in args.fp32_methods.split(",") if m in methods]
    return res | benches(args, dev, out_dir, "", methods, fp32, profile)


def part_heads(args, dev: torch.device, out_dir: Path) -> dict:
    """Part ``heads``: distil an eagle head into the embedded profile on this device, then bench it."""
    res: dict = {"calibrate": calibrated(args, dev, out_dir)}
    if not res["calibrate"]["ok"]:
        return res
    profile, heads = out_dir / "profile", out_dir / "head-domains"
    window = f"{args.skip_first}:{args.skip_first + max(args.per_category, args.fp32_per_category)}"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "specbench_domains.py"), "--exclude", window, args.data,
                    str(heads)], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    cmd = [*CLI, "distill", "--model", args.model, "--profile", str(profile), "--drafter", "eagle", "--device",
           dev.type, "--dtype", "bfloat16", "--minutes", str(args.head_minutes), "--quiet"]
    for f in sorted(heads.glob("*.jsonl")):
        cmd += ["--data", f"{f.stem}={f}"]
    res["distill"] = run(cmd, args.head_minutes * 60 + args.distill_extra, out_dir / "distill.log")
    if not res["distill"]["ok"]:
        return res
    from adaptive.profile import load_profile

    rec = load_profile(profile).distilled["eagle"]
    res["head"] = {"acceptance": rec.acceptance, "tau": rec.tau, "draft_cost": rec.draft_cost,
                   "train_seconds": rec.train_seconds, "seconds": rec.seconds, "coverage": rec.coverage,
                   "by_domain": {d: v[0] for d, v in rec.by_domain.items()}}  # each domain's first draft kept
    res["raced"] = raced(profile)
    return res | benches(args, dev, out_dir, "heads-", list(HEAD_METHODS), ["ar", "eagle"], profile)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                return r.status == 200
        except OSError:
            time.sleep(0.5)
    return False


def part_serving(args, dev: torch.device, out_dir: Path) -> dict:
    """``adaptive serve`` under 1 .. 64 streaming clients, speculation on and off, then transformers'
    batched static ``generate`` at the same batch sizes (the module doc)."""
    clients = QUICK_SERVE_CLIENTS if args.quick else SERVE_CLIENTS
    new_tokens = 8 if args.quick else 64
    res: dict = {"clients": list(clients), "max_new_tokens": new_tokens, "rows": [], "peer": []}
    cal = calibrated(args, dev, out_dir)
    if not cal["ok"]:
        res["error"] = f"calibration failed: {cal['tail'][-300:]}"
        return res
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out_dir / "serve.log"
    cmd = [*CLI, "serve", "--profile", str(out_dir / "profile"), "--model", args.model, "--engine", "torch",
           "--device", dev.type, "--dtype", "bfloat16", "--max-batch", str(max(clients)), "--port", str(port),
           "--max-queue", str(4 * max(clients)), "--no-online"]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            if not wait_ready(url, proc, args.calibrate_timeout):
                res["error"] = f"the server did not start: {log_path.read_text()[-300:]}"
                return res
            for n in clients:
                for speculation in ("auto", "off"):
                    load = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url", url,
                            "--data", args.data, "--skip-first", str(args.skip_first), "--clients", str(n),
                            "--requests", str(max(2 * n, 4)), "--max-tokens", str(new_tokens),
                            "--speculation", speculation]
                    out = subprocess.run(load, cwd=ROOT, capture_output=True, text=True, timeout=args.bench_timeout)
                    row = {"clients": n, "speculation": speculation}
                    if out.returncode != 0:
                        row["error"] = out.stderr[-300:]
                    else:
                        r = json.loads(out.stdout)
                        row.update({k: r[k] for k in ("tokens_per_s", "ttft_s", "itl_s", "server_errors",
                                                       "requests", "generated_tokens")})
                    res["rows"].append(row)
                    log(f"serving {n} clients, speculation {speculation}: {row.get('tokens_per_s', row.get('error'))}")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    res["batched_graphs"] = "batched steps replay CUDA graphs" in log_path.read_text()
    res["peer"] = [hf_static_batch(args, dev, n, new_tokens) for n in clients]
    return res


def hf_static_batch(args, dev: torch.device, batch: int, new_tokens: int) -> dict:
    """transformers' batched greedy ``generate`` with the static cache: ``batch`` held-out prompts,
    left-padded, every row decoding ``new_tokens``; tok/s of the second of two runs (the first compiles)."""
    from adaptive.models import load_model
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_load import prompts_from

    try:
        lm = load_model(args.model, device=dev.type, dtype="bfloat16", engine="torch")
        tok = lm.tokenizer
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        prompts = prompts_from(args.data, args.skip_first)
        texts = [tok.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}], tokenize=False,
                                         add_generation_prompt=True) for i in range(batch)]
        enc = tok(texts, return_tensors="pt", padding=True).to(dev)
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  cache_implementation="static", pad_token_id=tok.pad_token_id)
        with lm.backbone.module_weights():
            lm.model.generate(**enc, **kw)
            sync(dev)
            t0 = time.perf_counter()
            out = lm.model.generate(**enc, **kw)
            sync(dev)
            wall = time.perf_counter() - t0
        tokens = (out.shape[1] - enc["input_ids"].shape[1]) * batch
        row = {"batch": batch, "tokens_per_s": round(tokens / wall, 1), "seconds": round(wall, 3)}
    except Exception as exc:  # noqa: BLE001 - a failed peer is reported in the table, the check goes on
        row = {"batch": batch, "error": f"{type(exc).__name__}: {exc}"[:300]}
    log(f"transformers static batch {batch}: {row.get('tokens_per_s', row.get('error'))}")
    return row


def raced(profile_dir: Path) -> dict:
    """Each domain's decision and the speedups its race measured on its calibration prompts, by
    drafter: ``{domain: {"decision": drafter, "raced": {drafter: speedup}}}`` (set beside the bench's
    held-out speedups in the table)."""
    from adaptive.profile import load_profile

    prof = load_profile(profile_dir)
    return {name: {"decision": d.decision.drafter,  # a reduced-vocabulary ssd race is its own column
                   "raced": {m.drafter + ("+vocab" if m.draft_vocab else ""): m.speedup for m in d.measurements}}
            for name, d in prof.domains.items()}


def markdown(result: dict) -> str:
    lines = [f"# device check: {result['device']}", ""]
    shapes = result.get("shapes")
    if shapes:
        lines += [f"## (b) random-weight shapes, {shapes['dtype']}, one token after {result['context']} positions "
                  f"(device copy {shapes['bandwidth_GBps']} GB/s)", "",
                  "| shape | weights MB | eager ms | graph, plain kernels ms | graph, compiled pieces ms | "
                  "HBM share | verify k=1,2,4,8,16 (steps) | loop tok/s | chained tok/s, read every 8 / 63 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in shapes["rows"]:
            if "error" in r:
                lines.append(f"| {r['shape']} | failed: {r['error']} | | | | | | | |")
                continue
            v = r["verify"]
            lines.append(f"| {r['shape']} | {r['weight_MB']} | {r.get('eager_ms', r['step_ms'])} | "
                         f"{r.get('graph_none_ms', '-')} | {r.get('graph_ops_ms', '-')} | "
                         f"{r.get('hbm_share', '-')} | {v[0]}, {v[1]}, {v[3]}, {v[7]}, {v[15]} | {r['loop_tok_s']} | "
                         + (f"failed: {r['chain_error']}" if "chain_error" in r else ", ".join(
                             f"{r.get(f'chain{c}_tok_s', '-')}" + ("" if r.get(f"chain{c}_same", True)
                                                                   else " (TOKENS DIFFER)") for c in (8, 63)))
                         + " |")
        batched = [r for r in shapes["rows"] if "batch_verify" in r or "batch_error" in r]
        if batched:
            lines += ["", "verify table by batch size: a batched step of B requests feeding R = 1, 2, 4, 8 rows each, "
                      "in plain steps of one request", ""]
            for r in batched:
                table = r.get("batch_verify")
                cells = "; ".join(f"B={b}: {', '.join(map(str, v))}" for b, v in (table or {}).items())
                lines.append(f"- {r['shape']}: " + (cells if table else f"failed: {r['batch_error']}"))
    if "kernels" in result:
        lines += ["", "## where the plain step's time goes (the default step, captured on CUDA; torch.profiler)", "",
                  "| shape | step ms | kernels a step | kernel time ms | share of the step | top kernels (us a step) |",
                  "|---|---|---|---|---|---|"]
        for r in result["kernels"]["rows"]:
            if "error" in r:
                lines.append(f"| {r['shape']} | failed: {r['error']} | | | | |")
                continue
            top = "; ".join(f"{t['name'][:40]} x{t['per_step']} {t['us_per_step']}" for t in r["top"][:5])
            lines.append(f"| {r['shape']} | {r['step_ms']} | {r['kernels_per_step']} | {r['busy_ms']} | "
                         f"{r['busy_share']} | {top} |")
    if "compiled" in result:
        lines += ["", f"compiled (Inductor) steps captured, smollm2 shape: {json.dumps(result['compiled'])}"]
    emb = result.get("embedded")
    if emb:
        lines += ["", "## (a) embedded model, batch 1, 64 new tokens", "",
                  f"calibration: {'ok' if emb['calibrate']['ok'] else 'FAILED'} in {emb['calibrate']['seconds']} s",
                  "", "| method | bf16 tok/s | bf16 speedup | fp32 tok/s | fp32 identical to ar |",
                  "|---|---|---|---|---|"]
        b16 = emb.get("bench_bfloat16", {}).get("report", {})
        f32 = emb.get("bench_float32", {}).get("report", {})
        for m in sorted(set(b16) | set(f32), key=lambda m: EMBEDDED_METHODS.index(m) if m in EMBEDDED_METHODS else 99):
            a, b = b16.get(m, {}), f32.get(m, {})
            lines.append(f"| {m} | {a.get('tokens_per_s')} | {a.get('speedup')} | {b.get('tokens_per_s')} | "
                         f"{b.get('identical_to_ar')} |")
        runs = emb.get("bench_bfloat16", {}).get("runs", [])
        for m in sorted({r["method"] for r in runs if r.get("prefill_time_s") is not None}):
            mine = [r for r in runs if r["method"] == m]
            pre = statistics.mean(r["prefill_time_s"] for r in mine)
            lines.append(f"{m}: prefill {1e3 * pre:.1f} ms a prompt on average; "
                         f"{sum(1 for r in mine if r.get('graph_captures'))} of {len(mine)} runs captured graphs")
        if "knn-ssd" in b16:
            lines += ["", "knn-ssd by group (bf16 speedup over ar): " + ", ".join(
                f"{g} {v['speedup']}" for g, v in b16["knn-ssd"]["by_category"].items())]
        if emb.get("raced"):
            benched = {m: b16[m]["by_category"] for m in ("knn-ssd", "pld") if m in b16}
            drafters = sorted({d for r in emb["raced"].values() for d in r["raced"]})
            lines += ["", "raced on the calibration prompts against benched on held-out ones (speedup over ar)", "",
                      "| domain | decision | " + " | ".join(f"raced {d}" for d in drafters)
                      + " | " + " | ".join(f"benched {m}" for m in benched) + " |",
                      "|---|---|" + "---|" * (len(drafters) + len(benched))]
            for name, r in emb["raced"].items():
                lines.append(f"| {name} | {r['decision']} | "
                             + " | ".join(str(r["raced"].get(d, "-")) for d in drafters) + " | "
                             + " | ".join(str(b.get(name, {}).get("speedup", "-")) for b in benched.values()) + " |")
        for key in ("calibrate", "bench_bfloat16", "bench_float32"):
            if key in emb and not emb[key]["ok"]:
                lines += [f"{key} failed (rc {emb[key]['rc']}): " + " / ".join(emb[key]["tail"])]
    heads = result.get("heads")
    if heads:
        lines += ["", "## eagle head trained on this device (issue 61), batch 1, 64 new tokens", ""]
        head = heads.get("head")
        if head:
            lines += [f"first draft kept {head['acceptance']:.3f}, tau {head['tau']:.2f}, draft cost "
                      f"{head['draft_cost']:.3f} of a step, {head['train_seconds']:.0f} s of training "
                      f"({head['seconds']:.0f} s in all); by group: "
                      + ", ".join(f"{d} {v:.3f}" for d, v in head["by_domain"].items()), ""]
        b16 = heads.get("bench_bfloat16", {}).get("report", {})
        f32 = heads.get("bench_float32", {}).get("report", {})
        if b16 or f32:
            lines += ["| method | bf16 tok/s | bf16 speedup | tau | fp32 identical to ar |", "|---|---|---|---|---|"]
            for m in [m for m in HEAD_METHODS if m in b16 or m in f32]:
                a, b = b16.get(m, {}), f32.get(m, {})
                tau = a.get("mean_accepted_tokens", "-")
                lines.append(f"| {m} | {a.get('tokens_per_s')} | {a.get('speedup')} | {tau} | "
                             f"{b.get('identical_to_ar', '-')} |")
        for key in ("calibrate", "distill", "bench_bfloat16", "bench_float32"):
            if key in heads and not heads[key]["ok"]:
                lines += [f"heads: {key} failed (rc {heads[key]['rc']}): " + " / ".join(heads[key]["tail"])]
    srv = result.get("serving")
    if srv:
        lines += ["", f"## serving: adaptive serve, bf16, {srv['max_new_tokens']} new tokens, streaming greedy clients "
                  f"(batched graphs: {'yes' if srv.get('batched_graphs') else 'no'})", ""]
        if "error" in srv:
            lines += [f"failed: {srv['error']}"]
        lines += ["| clients | speculation | tok/s | TTFT median / p90 s | ITL median / p90 s | server errors |",
                  "|---|---|---|---|---|---|"]
        for r in srv["rows"]:
            if "error" in r:
                lines.append(f"| {r['clients']} | {r['speculation']} | failed: {r['error'][-120:]} | | | |")
                continue
            ttft, itl = r["ttft_s"], r["itl_s"]
            lines.append(f"| {r['clients']} | {r['speculation']} | {r['tokens_per_s']} | {ttft['median']} / "
                         f"{ttft['p90']} | {itl['median']} / {itl['p90']} | {r['server_errors']} |")
        lines += ["", "transformers batched generate, static cache: " + ", ".join(
            f"batch {r['batch']}: " + (f"{r['tokens_per_s']} tok/s" if "error" not in r else f"failed ({r['error']})")
            for r in srv["peer"])]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="shapes,embedded,heads,serving",
                    help="shapes, kernels, compile, embedded, heads, serving")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (the CPU run CI makes)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "spec_bench_dev.jsonl"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shapes", default="", help="only these shapes of part shapes (comma-separated names)")
    ap.add_argument("--per-category", type=int, default=4, help="benchmarked prompts of each group")
    ap.add_argument("--skip-first", type=int, default=16, help="prompts of each group left to calibration")
    ap.add_argument("--context", type=int, default=None, help="cached positions before a timed step [512; quick 32]")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per block [100; quick 3]")
    ap.add_argument("--methods", default=",".join(EMBEDDED_METHODS), help="the bf16 bench's methods")
    ap.add_argument("--calibration", choices=("quick", "full"), default="quick",
                    help="quick: 6 prompts a group (about 1 min on an H100); full: the default calibration")
    ap.add_argument("--fp32-methods", default="ar,knn-ssd,pld,hf,hf-pld", help="the fp32 equality run's methods")
    ap.add_argument("--fp32-per-category", type=int, default=2)
    ap.add_argument("--calibrate-timeout", type=float, default=150, help="seconds")
    ap.add_argument("--bench-timeout", type=float, default=270, help="seconds, the bf16 bench")
    ap.add_argument("--fp32-timeout", type=float, default=100, help="seconds, the fp32 bench")
    ap.add_argument("--head-minutes", type=float, default=5.0, help="part heads: the eagle head's training budget")
    ap.add_argument("--distill-extra", type=float, default=240,
                    help="seconds part heads' distillation may take beyond its budget (its data, the race)")
    ap.add_argument("--out", default="device-check")
    args = ap.parse_args()
    args.context = args.context or (32 if args.quick else 512)
    args.repeats = args.repeats or (3 if args.quick else 100)
    dev = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    result = {"device": name, "torch": torch.__version__, "context": args.context, "quick": args.quick}
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"shapes", "kernels", "compile", "embedded", "heads", "serving"}
    if unknown:
        sys.exit(f"unknown part(s) {', '.join(sorted(unknown))}; "
                 "choose shapes, kernels, compile, embedded, heads, serving")
    t0 = time.perf_counter()
    if "shapes" in parts:
        result["shapes"] = part_shapes(args, dev)
    if "kernels" in parts:
        result["kernels"] = part_kernels(args, dev)
    if "compile" in parts:
        result["compiled"] = part_compile(args, dev)
    if "embedded" in parts:
        result["embedded"] = part_embedded(args, dev, out_dir)
    if "heads" in parts:
        result["heads"] = part_heads(args, dev, out_dir)
    if "serving" in parts:
        result["serving"] = part_serving(args, dev, out_dir)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    tmp = out_dir / "device_check.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out_dir / "device_check.json")
    print(markdown(result))


if __name__ == "__main__":
    main()
