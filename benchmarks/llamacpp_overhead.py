"""Our per-token overhead on the llama.cpp engine (issue 44, item 7): plain decoding through our engine
against a bare loop of ``llama_decode`` calls on the same context, interleaved, in one process.

* ``ours``: ``Engine.generate`` with no drafter (the engine's plain path: its loop, acceptance, stop
  checks, detokenizing, statistics), decode time only (the prefill excluded);
* ``bare``: the same prompt prefilled by our backbone, then per token one ``llama_decode`` of one
  token through the backbone's ctypes batch and the argmax of llama.cpp's logits read in place
  (numpy over the pointer, no copy): what any Python caller of llama.cpp pays at least.

With ``--server``, also ``llama-server`` (built by ``benchmarks/build_llama_server.sh``; one slot, no
prompt cache) on the same GGUF, prompt and thread count: its wall time of the ``/completion`` request
less its own ``prompt_ms``, per token after the first (what a caller of llama-server waits per token,
HTTP included), and its own ``predicted_per_second``.

Ours and the bare loop produce the same tokens (checked; llama-server's build may part from them at a
near-tie, reported). Prints ms per token of each, their difference, and with ``--profile`` the top of
a cProfile of ``ours``.

    python benchmarks/llamacpp_overhead.py --tokens 64 --rounds 5 --profile
    python benchmarks/llamacpp_overhead.py --tokens 128 --rounds 8 --server
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np


def bare(bb, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding by bare ``llama_decode`` calls after our prefill: tokens and decode seconds."""
    lib = bb._lib
    cache = bb.new_cache(len(prompt) + n + 1)
    first = bb.forward(prompt, cache, 0, logits="last").logits[0]
    tok = int(first.argmax())
    out, pos = [tok], len(prompt)
    b = bb._batch
    t = time.perf_counter()
    for _ in range(n - 1):
        b.token[0], b.pos[0], b.n_seq_id[0], b.seq_id[0][0], b.logits[0] = tok, pos, 1, cache.seq, True
        b.n_tokens = 1
        if lib.llama_decode(bb._ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        row = np.ctypeslib.as_array(lib.llama_get_logits(bb._ctx), shape=(bb.vocab_size,))
        tok = int(row.argmax())
        out.append(tok)
        pos += 1
    dt = time.perf_counter() - t
    cache.written = pos
    return out, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--server", action="store_true", help="also llama-server on the same GGUF (one slot, no cache)")
    args = ap.parse_args()
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine
    from adaptive.models import load_model

    lm = load_model(args.model, engine="llama.cpp", threads=args.threads)
    engine = Engine(lm)
    bb = lm.backbone
    prompt = engine.encode([{"role": "user", "content": "Explain why the sky is blue, in a few sentences."}])
    cfg = GenerationConfig(max_new_tokens=args.tokens, ignore_eos=True)

    def ours():
        r = engine.generate(prompt, cfg)
        s = r.stats
        return r.token_ids, s.total_time - s.prefill_time

    server = None
    if args.server:
        from adaptive.bench.llama_server import LlamaServer

        server = LlamaServer(bb.path, threads=bb.threads, n_ctx=len(prompt) + args.tokens + 64)

    def served():
        ids, wall = server.generate(prompt, args.tokens, set(), ignore_eos=True)
        timings = server.last_timings
        per["server (own timing)"].append(1e3 / timings["predicted_per_second"])
        return ids, wall - timings["prompt_ms"] / 1e3

    runs = {"ours": ours, "bare": lambda: bare(bb, prompt, args.tokens)}
    if server is not None:
        runs["server"] = served
    per = {name: [] for name in runs} | ({"server (own timing)": []} if server is not None else {})
    try:
        for run in runs.values():  # warm
            run()
        per = {name: [] for name in per}
        outputs = {}
        for i in range(args.rounds):
            names = list(runs)
            for name in names[i % len(names):] + names[:i % len(names)]:
                ids, dt = runs[name]()
                per[name].append(1e3 * dt / (len(ids) - 1))
                outputs[name] = ids
    finally:
        if server is not None:
            server.close()
    assert outputs["bare"] == outputs["ours"], "ours and the bare loop decoded different tokens"
    if "server" in outputs and outputs["server"] != outputs["ours"]:  # another build's kernels: near-ties may part
        same = next(i for i, (a, b) in enumerate(zip(outputs["server"] + [None], outputs["ours"] + [None])) if a != b)
        print(f"llama-server's tokens part from ours at token {same} (another build of llama.cpp)")
    med = {name: statistics.median(v) for name, v in per.items()}
    o, b = med["ours"], med["bare"]
    print(f"ms per token (median of {args.rounds}): ours {o:.3f}, bare llama_decode loop {b:.3f}, "
          f"overhead {o - b:.3f} ms ({100 * (o - b) / b:.1f}% of a bare step)")
    if server is not None:
        sv = med["server"]
        print(f"llama-server {sv:.3f} ms per token by the request's wall time ({med['server (own timing)']:.3f} by its "
              f"own timing): ours at {sv / o:.3f}x its pace")
    print({name: [round(x, 3) for x in v] for name, v in per.items()})
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            ours()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue())


if __name__ == "__main__":
    main()
