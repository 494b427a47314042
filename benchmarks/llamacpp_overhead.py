"""Our per-token overhead on the llama.cpp engine (issue 44, item 7): plain decoding through our engine
against a bare loop of ``llama_decode`` calls on the same context, interleaved, in one process.

* ``ours``: ``Engine.generate`` with no drafter (the engine's plain path: its loop, acceptance, stop
  checks, detokenizing, statistics), decode time only (the prefill excluded);
* ``bare``: the same prompt prefilled by our backbone, then per token one ``llama_decode`` of one
  token through the backbone's ctypes batch and the argmax of llama.cpp's logits read in place
  (numpy over the pointer, no copy): what any Python caller of llama.cpp pays at least.

Both produce the same tokens (checked). Prints ms per token of each, their difference, and with
``--profile`` the top of a cProfile of ``ours``.

    python benchmarks/llamacpp_overhead.py --tokens 64 --rounds 5 --profile
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

    ours()
    bare(bb, prompt, args.tokens)  # warm
    per = {"ours": [], "bare": []}
    for i in range(args.rounds):
        for name in (("ours", "bare") if i % 2 == 0 else ("bare", "ours")):
            ids, dt = ours() if name == "ours" else bare(bb, prompt, args.tokens)
            per[name].append(1e3 * dt / (len(ids) - 1))
            if name == "ours":
                ref = ids
            else:
                check = ids
    assert ref == check, "ours and the bare loop decoded different tokens"
    o, b = statistics.median(per["ours"]), statistics.median(per["bare"])
    print(f"ms per token (median of {args.rounds}): ours {o:.3f}, bare llama_decode loop {b:.3f}, "
          f"overhead {o - b:.3f} ms ({100 * (o - b) / b:.1f}% of a bare step)")
    print("ours:", [round(x, 3) for x in per["ours"]], "bare:", [round(x, 3) for x in per["bare"]])
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
