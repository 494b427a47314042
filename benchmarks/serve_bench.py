"""Through the server, as users call it: `adaptive serve` against llama.cpp's C++ `llama-server`.

Both servers up at once (ours: ``adaptive serve --profile DIR --max-batch N``, started here unless
``--url`` names a running one; theirs: :class:`adaptive.bench.llama_server.LlamaServer` with
``-np N``, ``-t``/``-tb`` ``--threads``, ``--slot-context`` x N positions, on the profile's GGUF or
each ``--llama-model``), and chat requests ``[{"role": "user", "content": PROMPT}]`` streamed to
their ``/v1/chat/completions`` through the ``openai`` Python client, in waves of ``--clients`` N
concurrent requests: a wave's prompts go to one server, then the same prompts to the other, the
order rotated every wave (one client: request i to ours then the peer, swapped every other prompt),
so that drift hits both alike. Each server gets one untimed warm-up request after it starts.

Sampling is the same on both: ``temperature`` T (each of ``--temperatures``), ``top_p`` 1,
``seed`` (``--seed`` plus the prompt's position), and for llama-server ``top_k`` 0 and ``min_p`` 0
(its own defaults would truncate the distribution; our server refuses those fields, so they go to
llama-server only, in ``extra_body``). Both servers keep their prompt caches on, as users run them
(ours ``--prefix-cache``, llama-server's ``cache_prompt``; ``--no-prompt-cache``: both off), so no
prompt is asked twice in a run: the held-out prompts of each group (``--skip-first``) are dealt out
to the temperatures, ``--per-category`` to each (and to each client count too when ``--url`` keeps
one server of ours across them; otherwise both servers are restarted for each client count and each
count asks the same prompts). Our server runs with online learning off unless ``--online`` (then into
a fresh overlay, never the profile's).

Reports per (clients, temperature), for each server and by group (Spec-Bench category group):
aggregate throughput (completion tokens over wall seconds, ours over theirs), the median time to
first token, the pace after the first token (tokens after the first over the time from the first to
the last, summed over requests), both servers' prompt tokens; for each of our requests the engine,
domain, drafter, and the engine choice's predicted time (the chosen engine's ``expected_s`` in
``usage.adaptive.engine_choice``; two-engine profiles only) against the measured one (send to last
token), and the share of predictions within 20 % of it. JSON to ``--out``, a table on stdout,
progress on stderr. Needs ``benchmarks/build_llama_server.sh`` run first.

    python benchmarks/serve_bench.py --profile /tmp/sb-prof --data ../shared/data/spec_bench_dev.jsonl \\
        --skip-first 16 --per-category 3 --max-tokens 64 --temperatures 0,0.7,1.0 --clients 1 --clients 8 \\
        --seed 0 --out serve-bench.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
OURS = "adaptive"
PEER = "llama-server"
WITHIN = 0.2  # a prediction is good when within this share of the measured time
WARM_PROMPT = "Warm-up request: reply with one short greeting."  # untimed; never one of the benchmark's prompts
PEER_SAMPLER = {"top_k": 0, "min_p": 0}  # llama-server's truncations off: the model's own distribution


# -- pure parts ------------------------------------------------------------------------------------

def deal(prompts: list, parts: int) -> list[list]:
    """``prompts`` (each with a ``group``) dealt out to ``parts`` passes: within each group the j-th
    prompt goes to pass ``j % parts``, so no prompt is in two passes and each pass gets every group;
    each pass round robin over its groups (:func:`adaptive.bench.data.mixed_stream`: groups sorted,
    file order within a group), so that a wave of concurrent requests mixes groups.
    Example: ``q1 q2 q3 q4`` (qa), ``m1 m2`` (math) into 2: ``[m1 q1 q3]`` and ``[m2 q2 q4]``."""
    from adaptive.bench.data import mixed_stream

    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    by_group: dict[str, list] = defaultdict(list)
    for p in prompts:
        by_group[p.group].append(p)
    return [mixed_stream([p for q in by_group.values() for p in q[k::parts]]) for k in range(parts)]


def waves(items: list, clients: int) -> list[list]:
    """``items`` in consecutive waves of ``clients`` (the last one may be short)."""
    return [items[i:i + clients] for i in range(0, len(items), clients)]


def wave_order(servers: list[str], wave: int) -> list[str]:
    """The order the servers run wave ``wave`` in: rotated by one each wave (two servers: swapped every
    other wave). ``wave_order(["a", "b"], 1) == ["b", "a"]``."""
    k = wave % len(servers)
    return servers[k:] + servers[:k]


def request_metrics(send: float, first: float | None, last: float | None, tokens: int) -> dict:
    """One streamed request's times (seconds on one clock): sent at ``send``, its first and last
    tokens arrived at ``first`` and ``last`` (``None``: no text came), ``tokens`` completion tokens.
    ``ttft_s`` = first - send, ``latency_s`` = last - send (the measured time), ``decode_s`` = last -
    first, spent on ``tokens_after_first`` = tokens - 1.
    Example: ``(10.0, 10.5, 12.5, 5)``: TTFT 0.5 s, latency 2.5 s, 4 tokens in 2.0 s after the first."""
    if first is None or last is None:
        return {"ttft_s": None, "latency_s": None, "decode_s": 0.0, "tokens": tokens, "tokens_after_first": 0}
    return {"ttft_s": first - send, "latency_s": last - send, "decode_s": last - first, "tokens": tokens,
            "tokens_after_first": max(tokens - 1, 0)}


def wave_walls(records: list[dict]) -> dict[tuple[str, int], float]:
    """Each (server, wave)'s wall seconds: from its first request's send to its last token. Records:
    ``server``, ``wave``, ``send``, ``last`` (``None``: a failed request, left out)."""
    spans: dict[tuple[str, int], list[float]] = {}
    for r in records:
        if r.get("last") is None:
            continue
        key = (r["server"], r["wave"])
        lo, hi = spans.get(key, (r["send"], r["last"]))
        spans[key] = (min(lo, r["send"]), max(hi, r["last"]))
    return {k: hi - lo for k, (lo, hi) in spans.items()}


def aggregate(rows: list[dict], wall_s: float) -> dict:
    """The figures of a set of :func:`request_metrics` rows whose requests took ``wall_s`` in all:
    ``tokens_per_s`` (completion tokens / ``wall_s``), ``ttft_median_s``, ``pace_tokens_per_s``
    (tokens after the first / seconds from the first to the last token, each summed over the rows;
    ``None`` where no request had two tokens), ``latency_median_s`` and the counts."""
    ok = [r for r in rows if r["latency_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    paced = [r for r in ok if r["decode_s"] > 0 and r["tokens_after_first"] > 0]
    after, decode = sum(r["tokens_after_first"] for r in paced), sum(r["decode_s"] for r in paced)
    med = lambda xs: statistics.median(xs) if xs else None
    return {"requests": len(ok), "completion_tokens": tokens,
            "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
            "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
            "ttft_median_s": med([r["ttft_s"] for r in ok]),
            "pace_tokens_per_s": after / decode if decode > 0 and after > 0 else None,
            "latency_median_s": med([r["latency_s"] for r in ok])}


def summarize(records: list[dict]) -> dict[str, dict]:
    """By server: ``all`` (:func:`aggregate` over its requests, the wall the sum of its waves' walls)
    and ``groups`` (the same per group, the wall the sum of the group's request times: with one client
    the group's share of the wall, with several the per-client rate, since a wave mixes groups).
    Records: :func:`request_metrics`' fields plus ``server``, ``group``, ``wave``, ``send``, ``last``."""
    walls = wave_walls(records)
    out: dict[str, dict] = {}
    for server in sorted({r["server"] for r in records}):
        mine = [r for r in records if r["server"] == server]
        wall = sum(s for (sv, _), s in walls.items() if sv == server)
        groups = {}
        for g in sorted({r["group"] for r in mine}):
            rows = [r for r in mine if r["group"] == g]
            groups[g] = aggregate(rows, sum(r["latency_s"] for r in rows if r["latency_s"] is not None))
        out[server] = {"all": aggregate(mine, wall), "groups": groups}
    return out


def ratios(summary: dict[str, dict], ours: str, peer: str) -> dict:
    """Ours over the peer, overall (``all``) and by group: throughput and pace (above 1: ours faster)
    and median TTFT (below 1: ours first). ``None`` where either side has no figure."""
    def one(a: dict, b: dict) -> dict:
        div = lambda x, y: x / y if x is not None and y else None
        return {"tokens_per_s": div(a["tokens_per_s"], b["tokens_per_s"]),
                "pace": div(a["pace_tokens_per_s"], b["pace_tokens_per_s"]),
                "ttft_median": div(a["ttft_median_s"], b["ttft_median_s"])}
    a, b = summary[ours], summary[peer]
    return {"all": one(a["all"], b["all"]),
            "groups": {g: one(a["groups"][g], b["groups"][g]) for g in a["groups"] if g in b["groups"]}}


def _chosen_estimate(adaptive: dict | None) -> dict | None:
    choice = (adaptive or {}).get("engine_choice")
    if not choice:
        return None
    return next((e for e in choice.get("estimates") or () if e.get("engine") == choice.get("engine")), None)


def predicted_s(adaptive: dict | None) -> float | None:
    """The engine choice's predicted seconds in a ``usage.adaptive`` object: the chosen engine's
    ``expected_s`` among ``engine_choice.estimates`` (``None``: no choice was made, a one-engine profile)."""
    e = _chosen_estimate(adaptive)
    return None if e is None else float(e["expected_s"])


def priced_s(adaptive: dict | None, tokens: int) -> float | None:
    """The chosen engine's price for the ``tokens`` the request did decode: its ``prefill_s`` and
    ``tokens`` at its ``per_token_s`` (the cost model alone, apart from where the answer was expected
    to end), compared with the runtime's own ``seconds`` on the request (queue and HTTP left out).
    Example: prefill 0.1 s, 0.01 s a token, 20 tokens: 0.3 s."""
    e = _chosen_estimate(adaptive)
    if e is None or "per_token_s" not in e:
        return None
    return float(e["prefill_s"]) + tokens * float(e["per_token_s"])


def within_share(pairs: list[tuple[float | None, float | None]], tolerance: float = WITHIN) -> dict:
    """Of (predicted, measured) seconds pairs, those with both: how many, how many predicted within
    ``tolerance`` of measured (|p - m| <= tolerance * m), and that share (``None`` with none).
    Example: ``[(1.0, 1.1), (2.0, 1.0), (None, 1.0)]``: 2 with both, 1 within, share 0.5."""
    both = [(p, m) for p, m in pairs if p is not None and m is not None and m > 0]
    within = sum(abs(p - m) <= tolerance * m for p, m in both)
    return {"requests": len(both), "within": within, "share": within / len(both) if both else None}


# -- servers and requests ----------------------------------------------------------------------------

def _sibling(name: str):
    """``benchmarks/<name>.py`` as a module (its ``main()`` not run)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def profile_gguf(profile: str, model: str | None) -> Path:
    """The GGUF file the profile's model (or ``--model``) loads from, for llama-server."""
    from adaptive.models import gguf_of
    from adaptive.profile import load_profile

    spec = model or load_profile(profile).model.spec
    path = gguf_of(spec) if spec else None
    if path is None:
        raise SystemExit(f"serve_bench: the model {spec or '(none recorded)'} is not a GGUF file; "
                         "name llama-server's with --llama-model")
    return path


def stream_one(client, model: str, prompt: str, max_tokens: int, temperature: float, seed: int,
               extra: dict | None, t0: float) -> dict:
    """Stream one chat request; its times relative to ``t0``, usage and text (``error`` when it failed)."""
    send = time.perf_counter()
    first = last = None
    usage: dict = {}
    timings: dict = {}
    pieces: list[str] = []
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, top_p=1.0, seed=seed, stream=True, stream_options={"include_usage": True},
            extra_body=extra or None)
        for chunk in stream:
            now = time.perf_counter()
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and delta.content:
                pieces.append(delta.content)
                last = now
                if first is None:
                    first = now
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            timings = (chunk.model_extra or {}).get("timings") or timings  # llama-server's own counts
        error = None
    except Exception as exc:  # the openai client's errors, a broken stream: counted, not fatal
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    tokens = usage.get("completion_tokens") or timings.get("predicted_n") or len(pieces)
    rel = lambda t: None if t is None else t - t0
    return {"send": send - t0, "first": rel(first), "last": rel(last), "tokens": int(tokens) if not error else 0,
            "prompt_tokens": usage.get("prompt_tokens") or timings.get("prompt_n"),
            "adaptive": usage.get("adaptive"), "text": "".join(pieces), "error": error}


class Server:
    """One server under test: its label, an ``openai`` client on its URL, the model name it serves and
    what its requests add to the body (``extra_body``)."""

    def __init__(self, label: str, url: str, extra: dict | None):
        from openai import OpenAI

        self.label, self.url, self.extra = label, url, extra
        self.client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=1800)
        self.model = self.client.models.list().data[0].id

    def warm(self, max_tokens: int) -> None:
        r = stream_one(self.client, self.model, WARM_PROMPT, min(max_tokens, 8), 0.0, 0, self.extra, 0.0)
        if r["error"]:
            raise SystemExit(f"serve_bench: {self.label}'s warm-up request failed: {r['error']}")


def run_pass(servers: list[Server], prompts: list, clients: int, temperature: float, args, t0: float,
             wave_base: int, tag: str) -> list[dict]:
    """The prompts in waves of ``clients`` on each server, the servers' order rotated each wave; one
    record a request."""
    records = []
    labels = [s.label for s in servers]
    by_label = {s.label: s for s in servers}
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for w, wave in enumerate(waves(prompts, clients)):
            for label in wave_order(labels, wave_base + w):
                s = by_label[label]
                futures = [(p, pool.submit(stream_one, s.client, s.model, p.turns[0], args.max_tokens, temperature,
                                           args.seed + p.position, s.extra, t0)) for p in wave]
                for p, f in futures:
                    r = f.result()
                    m = request_metrics(r["send"], r["first"], r["last"], r["tokens"])
                    rec = {"server": label, "clients": clients, "temperature": temperature, "wave": wave_base + w,
                           "id": p.id, "group": p.group, "category": p.category, **m, **r}
                    if not args.texts:
                        del rec["text"]
                    if label == OURS:
                        a = r["adaptive"] or {}
                        rec.update(engine=a.get("engine"), domain=a.get("domain"), drafter=a.get("drafter"),
                                   policy=a.get("policy"), predicted_s=predicted_s(a),
                                   priced_s=priced_s(a, rec["tokens"]), server_s=a.get("seconds"))
                    records.append(rec)
                failed = [r["error"] for r in records[-len(wave):] if r["error"] is not None]
                tok = sum(r["tokens"] for r in records[-len(wave):])
                log(f"{tag} wave {w + 1}: {label} {tok} tokens"
                    + (f", {len(failed)} failed ({failed[0][:160]})" if failed else ""))
    return records


def pass_report(records: list[dict], peers: list[str]) -> dict:
    summary = summarize([r for r in records if r["error"] is None])
    ours = [r for r in records if r["server"] == OURS and r["error"] is None]
    return {"servers": summary,
            "vs": {p: ratios(summary, OURS, p) for p in peers if OURS in summary and p in summary},
            "predictions": within_share([(r.get("predicted_s"), r["latency_s"]) for r in ours]),
            "cost_model": within_share([(r.get("priced_s"), r.get("server_s")) for r in ours]),
            "errors": {s: sum(r["server"] == s and r["error"] is not None for r in records)
                       for s in sorted({r["server"] for r in records})},
            "requests": records}


def table(p: dict, peers: list[str]) -> str:
    """The short human-readable table of one pass."""
    f = lambda x, fmt="{:.2f}": "-" if x is None else fmt.format(x)
    head = f"clients {p['clients']}, temperature {p['temperature']:g}, {p['prompts']} prompts"
    lines = [head, f"  {'server':<28} {'tok/s':>8} {'ours/it':>8} {'TTFT med s':>11} {'pace tok/s':>11} "
                   f"{'prompt tok':>10} {'errors':>6}"]
    for label, s in p["servers"].items():
        a = s["all"]
        vs = (p["vs"].get(label) or {}).get("all", {}).get("tokens_per_s")
        lines.append(f"  {label:<28} {f(a['tokens_per_s'], '{:.1f}'):>8} {f(vs) + ('x' if vs else ''):>8} "
                     f"{f(a['ttft_median_s'], '{:.3f}'):>11} {f(a['pace_tokens_per_s'], '{:.1f}'):>11} "
                     f"{a['prompt_tokens']:>10} {p['errors'].get(label, 0):>6}")
    for peer in peers:
        if peer not in p["vs"]:
            continue
        lines.append(f"  by group, ours/{peer}: tok/s, pace, TTFT")
        for g, v in p["vs"][peer]["groups"].items():
            lines.append(f"    {g:<26} {f(v['tokens_per_s']):>6}x {f(v['pace']):>6}x {f(v['ttft_median']):>6}x")
    for key, what in (("predictions", "engine choice's prediction within {:.0%} of the measured time"),
                      ("cost_model", "its price at the tokens decoded within {:.0%} of the runtime's time")):
        pr = p[key]
        lines.append(f"  {what.format(WITHIN)}: " + (f"{pr['within']} of {pr['requests']} ({pr['share']:.0%})"
                                                      if pr["requests"] else "none (one-engine profile)"))
    return "\n".join(lines)


def temperatures(text: str) -> list[float]:
    out = [float(t) for t in text.split(",") if t.strip()]
    if not out or len(set(out)) != len(out) or any(not 0 <= t <= 2 for t in out):
        raise argparse.ArgumentTypeError(f"temperatures must be distinct numbers from 0 to 2, got {text!r}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="adaptive serve's profile")
    ap.add_argument("--model", default=None, help="adaptive serve's --model (default: the profile's)")
    ap.add_argument("--url", default=None, help="an adaptive serve already running here, instead of starting one")
    ap.add_argument("--llama-model", action="append", default=None,
                    help="the GGUF llama-server serves (default: the profile's model); repeat for more peers")
    ap.add_argument("--data", required=True, help="Spec-Bench-format prompts (JSONL)")
    ap.add_argument("--skip-first", type=int, default=16, help="prompts of each group left out (calibrated on)")
    ap.add_argument("--per-category", type=int, default=3, help="prompts of each group for each pass")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=temperatures, default=[0.0, 0.7, 1.0], help="comma-separated")
    ap.add_argument("--clients", type=int, action="append", default=None,
                    help="concurrent clients (repeatable; default 1); --max-batch and -np are set to it")
    ap.add_argument("--seed", type=int, default=0, help="each request's seed: this plus the prompt's position")
    ap.add_argument("--threads", type=int, default=None, help="llama-server's -t/-tb (default: this process's CPUs, "
                    "as ours)")
    ap.add_argument("--slot-context", type=int, default=4096, help="llama-server's context per slot (-c: this x N)")
    ap.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                    help="both prompt caches off (ours --prefix-cache 0, llama-server's cache_prompt false)")
    ap.add_argument("--online", action="store_true", help="our server learns online (into a fresh overlay)")
    ap.add_argument("--texts", action="store_true", help="keep each request's streamed text in the report")
    ap.add_argument("--out", default="serve-bench.json")
    args = ap.parse_args(argv)
    args.clients = args.clients or [1]
    if any(c < 1 for c in args.clients) or len(set(args.clients)) != len(args.clients):
        ap.error("--clients must be distinct counts >= 1")
    if args.per_category < 1 or args.max_tokens < 1:
        ap.error("--per-category and --max-tokens must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from adaptive.bench.data import load_bench_prompts
    from adaptive.bench.llama_server import LlamaServer, find_server
    from adaptive.engine.llamacpp_host import default_threads
    from adaptive.errors import AdaptiveError

    try:
        find_server()  # at once, before any model loads: a one-line error naming the build script
        ggufs = [Path(g) for g in args.llama_model] if args.llama_model else [profile_gguf(args.profile, args.model)]
        for g in ggufs:
            if not g.is_file():
                raise SystemExit(f"serve_bench: no GGUF file at {g}")
        threads = args.threads or default_threads()
        # one set of prompts per pass; each client count its own when our server is not restarted between them
        reused = args.url is not None and len(args.clients) > 1
        parts = len(args.temperatures) * (len(args.clients) if reused else 1)
        selected = load_bench_prompts(args.data, per_category=args.per_category * parts, skip_first=args.skip_first)
    except AdaptiveError as exc:
        raise SystemExit(f"serve_bench: {exc}") from None
    # a request's seed: the prompt's position in the selection, the same on every server
    prompts = [SimpleNamespace(id=p.id, group=p.group, category=p.category, turns=p.turns, position=i)
               for i, p in enumerate(selected)]
    dealt = deal(prompts, parts)
    peer_labels = [PEER if len(ggufs) == 1 else f"{PEER}:{g.name}" for g in ggufs]
    if len(set(peer_labels)) != len(peer_labels):
        raise SystemExit("serve_bench: --llama-model files need distinct names")
    log(f"{len(selected)} prompts in {len({p.group for p in selected})} groups, {parts} passes of "
        f"{', '.join(str(len(d)) for d in dealt)}; llama-server on {', '.join(map(str, ggufs))}, {threads} threads")

    serve_batch = _sibling("serve_batch")  # adaptive serve's start and stop, as serve_batch.py runs it
    from adaptive.engine.prefix import DEFAULT_PREFIX_CACHE_MIB
    from adaptive.serve import DEFAULT_PREFILL_CHUNK

    serve_args = SimpleNamespace(profile=args.profile, model=args.model, prefill_chunk=DEFAULT_PREFILL_CHUNK,
                                 prefix_cache=DEFAULT_PREFIX_CACHE_MIB if args.prompt_cache else 0,
                                 goodput=True, online=args.online)
    t0 = time.perf_counter()
    passes, wave_base = [], 0
    for ci, clients in enumerate(args.clients):
        proc, peers = None, []
        try:
            if args.url:
                url = args.url
                log(f"adaptive serve at {url} (its --max-batch should be {clients})")
            else:
                log(f"starting adaptive serve --max-batch {clients} ...")
                proc, url = serve_batch.start_server(serve_args, clients)
            try:
                for g in ggufs:
                    log(f"starting llama-server -np {clients} on {g.name} ...")
                    peers.append(LlamaServer(g, threads, args.slot_context * clients, slots=clients,
                                             cache_prompt=args.prompt_cache))
            except AdaptiveError as exc:
                raise SystemExit(f"serve_bench: {exc}") from None
            servers = [Server(OURS, url, None)] + [Server(lbl, p.url, PEER_SAMPLER)
                                                   for lbl, p in zip(peer_labels, peers)]
            for s in servers:
                s.warm(args.max_tokens)
            for ti, temp in enumerate(args.temperatures):
                part = dealt[ti + (ci * len(args.temperatures) if reused else 0)]
                tag = f"[clients {clients}, T {temp:g}]"
                records = run_pass(servers, part, clients, temp, args, t0, wave_base, tag)
                wave_base += len(waves(part, clients))
                p = {"clients": clients, "temperature": temp, "prompts": len(part),
                     "groups": sorted({q.group for q in part}), **pass_report(records, peer_labels)}
                passes.append(p)
                print(table(p, peer_labels), flush=True)
        finally:
            for peer in peers:
                peer.close()
            if proc is not None:
                serve_batch.stop_server(proc)

    report = {"profile": args.profile, "model": args.model, "url": args.url, "data": args.data,
              "skip_first": args.skip_first, "per_category": args.per_category, "max_tokens": args.max_tokens,
              "temperatures": args.temperatures, "clients": args.clients, "seed": args.seed, "threads": threads,
              "slot_context": args.slot_context, "prompt_cache": args.prompt_cache, "online": args.online,
              "llama_models": [str(g) for g in ggufs], "peers": peer_labels,
              "sampler": {"top_p": 1.0, "llama_server": PEER_SAMPLER}, "within": WITHIN, "passes": passes}
    Path(args.out).write_text(json.dumps(report, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
