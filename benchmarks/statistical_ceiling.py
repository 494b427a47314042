"""How far statistical drafting could take a bench's routed runtime: a ceiling by replay, in the bench's metric.

    python benchmarks/statistical_ceiling.py /tmp/sb/*.jsonl --model qwen2.5-coder-1.5b --engine torch \\
        --profile P --bench BENCH.json --cache /tmp/ceiling.json

The group files are named by group (``benchmarks/specbench_domains.py`` writes them); the profile is
the one the bench ran with, and its settings say how calibration built each domain's table. Per
group, the model's greedy continuations are made (stepped together, as calibration makes them) of:
the first ``prompts_per_domain`` prompts (calibration's), ``--extra`` prompts after them that the
bench did not hold out, and the bench's held-out prompts (its ``ar`` runs, matched by
``question_id``); each held-out prompt's prefill is timed alone. ``--cache`` keeps all of it.

Each held-out continuation is then decoded again by replay (``statistical_tables.replay``: exact
acceptance, each step costing the domain's measured verification of what it drafted, ``k`` its
cascade's draft length) and put into the bench's metric: the ``ar`` run's time split into the
measured prefill and the decoding, the decoding divided by the replay's speedup; a method's overall
figure is its mean tokens/s over ``ar``'s, per group and overall. Columns, each against ``ar``:

* ``measured``: what the bench measured for ``--method`` (default ``knn-ssd``);
* ``calibrated``: prompt lookup and calibration's table (the group's continuations of
  ``continuation_tokens`` and the other groups' as background, as :mod:`adaptive.measure.statistical`
  builds it): where the runtime decides the cascade, close to ``measured`` (this checks the replay);
* ``richer``: prompt lookup and a table of contexts of up to ``--order`` tokens (the longest one seen
  at least ``bigram_min_count`` times predicts) over the calibration and extra prompts' continuations
  of ``--tokens`` tokens: what more text and longer contexts would give;
* ``oracle``: each step takes whichever of prompt lookup alone, the calibrated and the richer
  drafter's proposals the model accepts most of (known here, as no drafter can know it), paying only
  that proposal's verification: above any choice or tree (which verifies all of them) of the three;
* ``oracle, free verification``: the same with every verification costing one plain step.

The last two are ceilings, not designs: they say what no way of drafting from these statistics can
pass on this model and machine, the prefill (the same for every method) included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from statistical_tables import replay  # noqa: E402  (the same replay as the table study)

from adaptive.calibrate.sources import read_prompt_rows  # noqa: E402
from adaptive.costs import verify_table  # noqa: E402
from adaptive.costs.model import best_draft_length  # noqa: E402
from adaptive.drafters.ngram import DEFAULT_BIGRAM_MIN_PROB, ngram_lookup, statistical_draft  # noqa: E402
from adaptive.measure.statistical import accepted_prefix, leave_one_out_table  # noqa: E402

Propose = Callable[[list[int], int], list[int]]  # (context, k) -> a draft of up to k tokens


class ContextTable:
    """Each context of 1 .. ``order`` tokens seen at least ``min_count`` times before one successor:
    that most frequent successor and its share. :meth:`chain` drafts from the longest context known.

    Example: ``[[1, 2, 3, 1, 2, 4, 7, 2, 4]]``, ``order = 2``: ``(2,)`` was followed by 3 once and by 4
    twice -> ``(4, 2/3)``; ``(1, 2)`` by 3 once and 4 once: below ``min_count = 2``, no entry.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], order: int, min_count: int = 2):
        if order < 1 or min_count < 1:
            raise ValueError(f"need order >= 1 and min_count >= 1, got {order}, {min_count}")
        counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for seq in sequences:
            s = [int(t) for t in seq]
            for n in range(1, order + 1):
                for i in range(n, len(s)):
                    counts[tuple(s[i - n:i])][s[i]] += 1
        self.order = order
        self.entries: dict[tuple[int, ...], tuple[int, float]] = {}
        for ctx, c in counts.items():
            tok, m = max(c.items(), key=lambda kv: (kv[1], -kv[0]))  # ties: the smaller id, as the bigram table
            if m >= min_count:
                self.entries[ctx] = (tok, m / sum(c.values()))

    def next(self, context: Sequence[int]) -> tuple[int, float] | None:
        """``(successor, share)`` of the longest known suffix of ``context``, or ``None``."""
        for n in range(min(self.order, len(context)), 0, -1):
            e = self.entries.get(tuple(context[-n:]))
            if e is not None:
                return e
        return None

    def chain(self, context: Sequence[int], k: int, min_prob: float = DEFAULT_BIGRAM_MIN_PROB) -> list[int]:
        """Up to ``k`` tokens, each the successor of the context so far, while the product of the
        shares stays at least ``min_prob`` (as :func:`~adaptive.drafters.ngram.bigram_chain`)."""
        ctx, out, chance = list(context), [], 1.0
        while len(out) < k:
            e = self.next(ctx)
            if e is None:
                break
            chance *= e[1]
            if chance < min_prob:
                break
            out.append(e[0])
            ctx.append(e[0])
        return out


def table_draft(table) -> Propose:
    """The statistical drafter with a bigram ``table`` (:func:`~adaptive.drafters.ngram.statistical_draft`)."""
    return lambda context, k: statistical_draft(context, k, table)


def richer_draft(table: ContextTable) -> Propose:
    """Prompt lookup, continued by ``table``'s chain (the statistical drafter's shape, a richer table)."""
    def propose(context, k):
        out = ngram_lookup(context, k)
        return out + table.chain(list(context) + out, k - len(out)) if len(out) < k else out
    return propose


def chain_nodes(propose: Propose, k: int):
    """A one-proposal drafter as ``statistical_tables.replay`` takes it (the proposal's prefixes)."""
    def nodes(context, left):
        d = propose(context, min(k, left))[:left]
        return {tuple(d[:j]) for j in range(1, len(d) + 1)}
    return nodes


def oracle_nodes(proposers: Sequence[Propose], k: int, text: Sequence[int]):
    """A drafter for ``statistical_tables.replay`` over one prompt + continuation ``text`` that knows
    it, as no real drafter can: each step it takes the proposal the text accepts most of (shortest
    among equals; none, a plain step, where no proposal's first token is right), so ``replay`` pays
    only that proposal's verification.

    Example: text ``[1, 5, 6, 7]`` (prompt ``[1]``), proposers drafting ``[9]`` and ``[6, 7]``, verify
    ``(1, 1, 1.5)``: from 6 on, ``[6, 7]`` is taken whole (2 tokens, cost 1.5) and the step ends the
    text: 2 / 1.5.
    """
    def nodes(context, left):
        ahead = text[len(context):]
        best, best_n = [], 0
        for propose in proposers:
            d = propose(context, min(k, left))[:left]
            n = accepted_prefix(d, ahead[:len(d)])
            if n > best_n or (n == best_n and best_n and len(d) < len(best)):
                best, best_n = d, n
        return {tuple(best[:j]) for j in range(1, len(best) + 1)}
    return nodes


def predicted_rate(new_tokens: int, ar_seconds: float, prefill_seconds: float, speedup: float) -> float:
    """Tokens/s of a run whose decoding (``ar_seconds`` less the prefill) goes ``speedup`` times faster.
    Example: 64 tokens in 10 s by ``ar`` with a 2 s prefill, decoding 2x faster: 64 / (2 + 4) = 10.67."""
    return new_tokens / (prefill_seconds + max(ar_seconds - prefill_seconds, 0.0) / speedup)


def make_data(args, groups: list[str], held_ids: dict[str, list[str]], settings: dict) -> dict:
    """Continuations and prefill times (see the module's docstring), per group."""
    from adaptive.calibrate.prepare import continue_together
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine
    from adaptive.engine.loop import new_cache, prefill
    from adaptive.models import load_model

    lm = load_model(args.model, engine=args.engine, weights="auto")
    engine = Engine(lm)
    data = {}
    for f, g in zip(args.files, groups):
        rows = read_prompt_rows(f)
        held = [r for r in rows if str(r.get("question_id")) in held_ids[g]]
        calib = rows[: settings["prompts_per_domain"]]
        extra = [r for r in rows[len(calib):] if r not in held][: args.extra]
        encode = lambda rs: [engine.encode(r["prompt"], chat=settings.get("chat")) for r in rs]  # noqa: E731
        train_ids, held_enc = encode(calib + extra), encode(held)
        train, _ = continue_together(engine, train_ids, GenerationConfig(max_new_tokens=args.tokens), None)
        conts, _ = continue_together(engine, held_enc, GenerationConfig(max_new_tokens=args.held_tokens), None)
        cfg = GenerationConfig(max_new_tokens=1)
        timed = {}
        for r, ids, cont in zip(held, held_enc, conts):
            best = float("inf")
            for _ in range(2):
                cache = new_cache(lm.backbone, len(ids), cfg)
                t0 = time.perf_counter()
                prefill(lm.backbone, ids, cache, cfg, None)
                best = min(best, time.perf_counter() - t0)
            timed[str(r["question_id"])] = [ids, cont, best]
        data[g] = {"calib": [[p, c] for p, c in zip(train_ids[: len(calib)], train[: len(calib)])],
                   "extra": [[p, c] for p, c in zip(train_ids[len(calib):], train[len(calib):])], "held": timed}
        print(f"{g}: continuations and prefills made", file=sys.stderr, flush=True)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--profile", required=True, type=Path, help="the profile directory the bench ran with")
    ap.add_argument("--bench", required=True, type=Path, help="an adaptive bench --out report")
    ap.add_argument("--method", default="knn-ssd")
    ap.add_argument("--model", default=None, help="default: the profile's model")
    ap.add_argument("--engine", default="torch")
    ap.add_argument("--cache", type=Path, default=None, help="continuations and prefills, reused when the file exists")
    ap.add_argument("--extra", type=int, default=12, help="more prompts per group for the richer table")
    ap.add_argument("--tokens", type=int, default=128, help="continuation length for the richer table")
    ap.add_argument("--order", type=int, default=3, help="longest context of the richer table")
    ap.add_argument("--target", type=float, default=1.5, help="the overall speedup a drafter would have to reach")
    args = ap.parse_args()
    profile = json.loads((args.profile / "profile.json").read_text())
    settings = profile["settings"]
    args.model = args.model or profile["model"]["name"]
    report = json.loads(args.bench.read_text())
    args.held_tokens = report["settings"]["max_new_tokens"]
    runs = defaultdict(dict)
    for r in report["runs"]:
        runs[r["id"]][r["method"]] = r
    groups = [f.stem for f in args.files]
    held_ids = {g: [i for i, m in runs.items() if m["ar"]["group"] == g] for g in groups}
    data = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    if any(g not in data for g in groups):
        data = make_data(args, groups, held_ids, settings)
        if args.cache:
            args.cache.write_text(json.dumps(data))
    min_count, L = settings["bigram_min_count"], settings["continuation_tokens"]
    columns = ("measured", "calibrated", "richer", "oracle", "oracle, free verification")
    rates: dict[str, list[dict]] = defaultdict(list)
    for g in groups:
        dom = profile["domains"][g]
        k = dom["cascade"]["draft_len"]
        verify, free = verify_table(dom["verify"], k), (1.0,) * (k + 1)
        own = [(p, c[:L]) for p, c in data[g]["calib"]]
        background = [(p[-1:], c[:L]) for h in groups if h != g for p, c in data[h]["calib"]]
        calibrated = leave_one_out_table(own, -1, min_count, background)
        richer_text = [p + c for p, c in data[g]["calib"] + data[g]["extra"]] + [
            p[-1:] + c for h in groups if h != g for p, c in data[h]["calib"] + data[h]["extra"]]
        richer = ContextTable(richer_text, args.order, min_count)
        proposers = [ngram_lookup, table_draft(calibrated), richer_draft(richer)]
        for qid in held_ids[g]:
            ar, m = runs[qid]["ar"], runs[qid].get(args.method)
            ids, cont, pre = data[g]["held"][qid]
            if len(ids) != ar["prompt_tokens"]:
                sys.exit(f"prompt {qid} encodes to {len(ids)} tokens here, {ar['prompt_tokens']} in the bench")
            cont = cont[: ar["new_tokens"]]
            pair, oracle = [(ids, cont)], oracle_nodes(proposers, k, list(ids) + list(cont))
            secs = ar["new_tokens"] / ar["tokens_per_s"]
            speedups = (*(replay(pair, verify, chain_nodes(p, k)) for p in proposers[1:]),
                        replay(pair, verify, oracle), replay(pair, free, oracle))
            row = {"ar": ar["tokens_per_s"], "measured": m["tokens_per_s"] if m else float("nan"),
                   "prefill share": pre / secs, "prefill": (len(ids), pre)}
            row.update({c: predicted_rate(ar["new_tokens"], secs, pre, s) for c, s in zip(columns[1:], speedups)})
            rates[g].append(row)
    print(f"{args.method} and statistical ceilings, each method's mean tokens/s over ar's (the bench's metric)\n")
    print("| group | prefill tok/s | prefill share of ar's time | ar tok/s | " + " | ".join(columns) + " |")
    print("|---" * (4 + len(columns)) + "|")
    everything = [r for g in groups for r in rates[g]]
    for name, rows in [(g, rates[g]) for g in groups] + [("all", everything)]:
        ar = statistics.mean(r["ar"] for r in rows)
        pre_rate = sum(r["prefill"][0] for r in rows) / sum(r["prefill"][1] for r in rows)
        cells = " | ".join(f"{statistics.mean(r[c] for r in rows) / ar:.2f}x" for c in columns)
        pre_share = statistics.mean(r["prefill share"] for r in rows)
        print(f"| {name} | {pre_rate:.0f} | {pre_share:.2f} | {ar:.2f} | {cells} |")
    share = statistics.mean(r["prefill share"] for r in everything)
    need = decoding_speedup_needed(args.target, share)
    verify = verify_table(profile["cost_model"]["verify"], settings["cascade_max_draft_len"])
    print(f"\n{args.target}x overall with prefill {share:.0%} of ar's time needs about {need:.2f}x on decoding alone; "
          "a drafter of one cost per token and one acceptance per token (the cost model's verification) needs:")
    for cost in (0.01, 0.05, 0.1, 0.25, 0.4):
        a = acceptance_needed(need, cost, verify)
        print(f"- draft cost {cost} of a step: " + (f"acceptance >= {a:.2f} per token" if a else "out of reach"))


def decoding_speedup_needed(target: float, share: float) -> float:
    """The decoding-only speedup that gives ``target`` overall when the prefill (not sped up) is ``share``
    of plain decoding's time. Example: 1.5x with a 25% prefill: ``0.75 / (1/1.5 - 0.25) = 1.8``."""
    if not 0 <= share < 1 / target:
        return float("inf")
    return (1 - share) / (1 / target - share)


def acceptance_needed(speedup: float, cost: float, verify: Sequence[float]) -> float | None:
    """The least per-token acceptance (to 0.01) at which a drafter of ``cost`` per token reaches
    ``speedup`` at its best draft length (:func:`~adaptive.costs.model.best_draft_length`, ``verify``
    a verify table); ``None`` if none below 1 does."""
    for a in range(1, 100):
        if best_draft_length(a / 100, cost, verify, len(verify) - 1)[1] >= speedup:
            return a / 100
    return None


if __name__ == "__main__":
    main()
