"""Which text the statistical drafter's table should hold, and whether several drafts per step would pay.

    python benchmarks/statistical_tables.py /tmp/sb/*.jsonl --model qwen2.5-coder-1.5b --engine torch \\
        --profile P --cache /tmp/conts.json

Per group file: the model's greedy continuations of the first ``--calib`` prompts (``--calib-tokens``,
as calibration makes them) and of ``--held-out`` prompts after the first ``--skip`` (``--tokens``).
Every held-out continuation is then decoded again by replay (greedy speculative decoding of the
model's own text, exact acceptance, each step costing the verification of what it drafted: the
cost model's ``verify`` from ``--profile``, else one step for any draft), with:

* ``own``: the statistical drafter (prompt lookup, then a bigram chain) with a table of the group's
  calibration text, as calibration built it until now;
* ``+background``: that table plus the other groups' continuations (after each prompt's last token),
  as calibration builds it now (:mod:`adaptive.measure.statistical`);
* ``+background, all prompts``: plus the other groups' prompts too;
* ``tree N``: the ``+background`` table, but each step verifies up to ``N`` draft tokens arranged as a
  tree: the drafter's own proposal and, beside it, what followed every other earlier occurrence of
  the context's suffix (latest first) and the table's other frequent successors of the last token,
  each continued by the chain. A step keeps the longest branch the text follows. No such tree is
  built in the runtime: this measures whether one would pay.

The model runs only to make the continuations (``--cache``: a JSON file reused when it exists).
Prints one markdown row per group: tokens per unit of cost (the replay's speedup over plain decoding).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from adaptive.calibrate.sources import read_prompt_rows
from adaptive.costs import verify_table
from adaptive.drafters.ngram import bigram_chain, build_bigram_table, statistical_draft
from adaptive.engine.config import GenerationConfig

TREE_SIZES = (6, 9, 12)


def continuations(engine, prompts: list[str], tokens: int) -> list[list[list[int]]]:
    cfg = GenerationConfig(max_new_tokens=tokens)
    out = []
    for p in prompts:
        ids = engine.encode(p)
        out.append([list(ids), [int(t) for t in engine.generate(ids, cfg).token_ids]])
    return out


def lookup_branches(context: list[int], k: int, max_ngram: int = 3) -> list[list[int]]:
    """What followed every earlier occurrence of the context's suffix, longest suffix first, latest first."""
    arr = np.asarray(context, dtype=np.int64)
    n_tok, out = arr.shape[0], []
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)
        for h in np.flatnonzero((windows == arr[n_tok - n:]).all(axis=1))[::-1]:
            branch = arr[h + n: h + n + k].tolist()
            if branch and branch not in out:
                out.append(branch)
    return out


def tree_paths(context: list[int], table, successors: dict, k: int, size: int) -> set[tuple[int, ...]]:
    """The prefixes (tree nodes) of the branches above, added in order until ``size`` nodes."""
    branches = [statistical_draft(context, k, table)]
    for b in lookup_branches(context, k):
        branches.append(b + bigram_chain(table, b[-1], k - len(b)) if len(b) < k else b)
    for tok, n in successors.get(context[-1], Counter()).most_common(3)[1:]:
        if n >= 2:
            branches.append([tok] + (bigram_chain(table, tok, k - 1) if k > 1 else []))
    nodes: set[tuple[int, ...]] = set()
    for b in branches:
        for j in range(1, len(b) + 1):
            if tuple(b[:j]) not in nodes:
                if len(nodes) >= size:
                    return nodes
                nodes.add(tuple(b[:j]))
    return nodes


def replay(pairs, verify: tuple[float, ...], propose) -> float:
    """Tokens per unit of cost decoding each ``(prompt, continuation)`` by replay; ``propose(context, left)``
    gives the step's tree as a set of token prefixes (a single draft's prefixes for a chain)."""
    tokens = cost = 0.0
    for prompt, cont in pairs:
        context, t = list(prompt) + cont[:1], 1
        while t < len(cont):
            left = len(cont) - t
            nodes = propose(context, left)
            n = 0
            while n < left and tuple(cont[t:t + n + 1]) in nodes:
                n += 1
            step = min(n + 1, left)
            cost += verify[min(len(nodes), len(verify) - 1)]
            tokens += step
            context.extend(cont[t:t + step])
            t += step
    return tokens / cost


def chain(table, k: int):
    def propose(context, left):
        d = statistical_draft(context, k, table)[:left]
        return {tuple(d[:j]) for j in range(1, len(d) + 1)}
    return propose


def tree(table, successors: dict, k: int, size: int):
    def propose(context, left):
        return tree_paths(context, table, successors, min(k, left), size)
    return propose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--model", default=None)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--profile", type=Path, default=None, help="read the cost model's verification costs")
    ap.add_argument("--cache", type=Path, default=None, help="continuations, reused when the file exists")
    ap.add_argument("--calib", type=int, default=12)
    ap.add_argument("--calib-tokens", type=int, default=48)
    ap.add_argument("--skip", type=int, default=16)
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--min-count", type=int, default=2)
    args = ap.parse_args()
    groups = [f.stem for f in args.files]
    data = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    if any(g not in data for g in groups):
        from adaptive.engine.engine import Engine
        from adaptive.models import DEFAULT_MODEL, load_model

        engine = Engine(load_model(args.model or DEFAULT_MODEL, engine=args.engine))
        for f, g in zip(args.files, groups):
            if g in data:
                continue
            prompts = [r["prompt"] for r in read_prompt_rows(f)]
            data[g] = {"calib": continuations(engine, prompts[: args.calib], args.calib_tokens),
                       "held": continuations(engine, prompts[args.skip: args.skip + args.held_out], args.tokens)}
            if args.cache:
                args.cache.write_text(json.dumps(data))
    verify = (1.0,)
    if args.profile:  # the cost model's, as calibration's replay uses (a domain's own are timed in 5 repeats)
        verify = tuple(json.loads((args.profile / "profile.json").read_text())["cost_model"]["verify"])
    print("| group | own | +background | +background, all prompts | "
          + " | ".join(f"tree {n}" for n in TREE_SIZES) + " |")
    print("|---" * (4 + len(TREE_SIZES)) + "|")
    for g in groups:
        v = verify_table(verify, max(TREE_SIZES) + 1)
        own = [p + c for p, c in data[g]["calib"]]
        others = [(p, c) for h in groups if h != g for p, c in data[h]["calib"]]
        own_t = build_bigram_table(own, args.min_count)
        bg_t = build_bigram_table(own + [p[-1:] + c for p, c in others], args.min_count)
        all_t = build_bigram_table(own + [p + c for p, c in others], args.min_count)
        successors = defaultdict(Counter)
        for s in own + [p[-1:] + c for p, c in others]:
            for a, b in zip(s, s[1:]):
                successors[a][b] += 1
        held = data[g]["held"]
        row = [replay(held, v, chain(t, args.k)) for t in (own_t, bg_t, all_t)]
        for n in TREE_SIZES:
            row.append(replay(held, v, tree(bg_t, successors, args.k, n)))
        print(f"| {g} | " + " | ".join(f"{x:.3f}" for x in row) + " |", flush=True)


if __name__ == "__main__":
    main()
