"""Does the race's block structure bias what it measures? Tokens per verification of prompt lookup in
calibration's paired blocks (:func:`adaptive.measure.timing.time_prompt`) against whole requests, on the
same prompts (device-independent: it counts steps, it does not time them).

    python benchmarks/race_blocks.py /tmp/sb/rag.jsonl --prompts 6      # a file of {"prompt": ...} lines
"""

from __future__ import annotations

import argparse
import json

from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.measure.timing import Candidate, time_prompt
from adaptive.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", help="JSONL with a 'prompt' (or Spec-Bench 'turns') per line")
    ap.add_argument("--prompts", dest="n", type=int, default=6, help="the first N prompts")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    lm = load_model(args.model, engine="torch", dtype="bfloat16")
    eng = Engine(lm)
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()][: args.n]
    race_tokens = race_steps = full_tokens = full_steps = 0
    for row in rows:
        ids = eng.encode([{"role": "user", "content": row.get("prompt") or row["turns"][0]}])
        t = time_prompt(lm, ids, {"lookup": Candidate("pld", args.draft_len)}, lambda: ["lookup"],
                        lambda ar, secs: None, block_tokens=args.block_tokens, max_tokens=args.max_tokens,
                        eos=lm.eos_ids())["lookup"]
        res = eng.generate(ids, GenerationConfig(max_new_tokens=args.max_tokens, draft_len=args.draft_len),
                           drafter=build_drafter(DrafterSpec("pld"), lm.backbone))
        made = len(res.token_ids) - 1  # the first token comes from the prefill, as in the race
        print(f"{len(ids)} prompt tokens: blocks {t['tokens']} tokens in {t['steps']} steps, "
              f"whole request {made} in {res.stats.steps}", flush=True)
        race_tokens, race_steps = race_tokens + t["tokens"], race_steps + t["steps"]
        full_tokens, full_steps = full_tokens + made, full_steps + res.stats.steps
    print(f"tokens per verification: blocks {race_tokens / race_steps:.3f}, "
          f"whole requests {full_tokens / full_steps:.3f}")


if __name__ == "__main__":
    main()
