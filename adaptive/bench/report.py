"""Aggregating benchmark runs into Spec-Bench's metrics; Markdown and PNG renderings.

A *run* is one (prompt, method) measurement: ``{"id", "group", "method", "new_tokens", "tokens_per_s",
"seconds", "steps", "drafted", "accepted", "identical", "violation"}`` (``steps`` is ``None`` for methods
that do not report them, e.g. Hugging Face's).
"""

from __future__ import annotations

from adaptive.measure.interval import bootstrap_speedup

REFERENCE = "ar"
INTERVAL_LEVEL = 0.9  # of the speedup's bootstrap interval over prompts


def summarize(runs: list[dict], methods: list[str], reference: str = REFERENCE) -> dict:
    """``{method: {speedup, tokens_per_s, mean_accepted_tokens, acceptance_rate, position_acceptance,
    identical_to_ar, differing_prompts, lossless_violations, prompts, by_category: {group: same fields}}}``.

    speedup = mean over prompts of the method's tokens/s / the same mean for ``reference``
    (``ar``; another method's name gives speedups over that method, the rest is unchanged);
    aggregate tokens/s = all new tokens / all the runs' seconds (prefill included: the mix's
    throughput, where a long prompt weighs by its time), ``aggregate_speedup`` its ratio to the
    reference's (runs without ``seconds``, from reports before it was recorded: ``None``);
    mean accepted tokens = (accepted + steps) / steps over all prompts (``ar`` = 1.0; tau: new tokens
    per target forward); acceptance rate = accepted / drafted; position acceptance: per draft
    position, the share of drafts that far all kept (:func:`position_acceptance`).
    ``speedup_interval``: ``[low, high]``, how far the speedup could move with other prompts of the
    same kind (:func:`speedup_interval`; ``None`` under two prompts run by both methods).

    Example: ar at 10 and 20 tok/s, ssd at 15 and 20: speedup ``17.5 / 15 = 1.1667``. With 60 tokens
    each, ar took 6 + 3 s and ssd 4 + 3 s: aggregate 120 / 9 = 13.333 and 120 / 7 = 17.143 tok/s,
    ``aggregate_speedup`` 1.2857.
    """
    out = {}
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        entry = _fields(mine, [r for r in runs if r["method"] == reference])
        groups = sorted({r["group"] for r in mine})
        entry["by_category"] = {g: _fields([r for r in mine if r["group"] == g],
                                           [r for r in runs if r["method"] == reference and r["group"] == g])
                                for g in groups}
        out[m] = entry
    return out


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _aggregate(runs: list[dict]) -> float | None:
    """All new tokens over all seconds (``None`` unless every run recorded its seconds)."""
    if not runs or any(r.get("seconds") is None for r in runs):
        return None
    seconds = sum(r["seconds"] for r in runs)
    return sum(r["new_tokens"] for r in runs) / seconds if seconds > 0 else None


def speedup_interval(mine: list[dict], ref: list[dict], level: float = INTERVAL_LEVEL) -> list[float] | None:
    """The percentile bootstrap interval (two-sided, ``level``) of the speedup ``mean(mine's tokens/s) /
    mean(ref's)`` over the prompts both ran (paired by ``id``), resampling prompts: how much of a
    difference between two methods the prompts drawn can explain. Deterministic (a fixed seed); ``None``
    under two such prompts. The ratio of means is a ratio of sums over the same prompts, the quantity
    :func:`~adaptive.measure.interval.bootstrap_speedup` resamples (there: seconds of paired blocks).

    Example: tokens/s 15 and 20 against 10 and 20 on two prompts: speedup 35 / 30 = 1.1667; resamples
    take prompt ``a`` twice (1.5), ``b`` twice (1.0) or one of each (1.1667), so at level 0.9 the
    interval is ``[1.0, 1.5]``."""
    theirs = {r["id"]: r["tokens_per_s"] for r in ref if r.get("tokens_per_s")}
    pairs = [(r["tokens_per_s"], theirs[r["id"]]) for r in mine if r.get("tokens_per_s") and r["id"] in theirs]
    if len(pairs) < 2:
        return None
    _, iv = bootstrap_speedup([a for a, _ in pairs], [b for _, b in pairs], level=level)
    return [iv.low, iv.high]


def position_acceptance(runs: list[dict], longest: int = 8) -> list[float]:
    """Per draft position ``i = 1 ..``: the share of steps that drafted at least ``i`` tokens whose first
    ``i`` were all kept, from the runs' ``draft_lengths`` and ``accept_hist`` (steps by tokens drafted, by
    tokens kept), pooled; up to ``longest`` positions, and none past the longest draft made.

    Example: one run whose steps drafted 2, 2 and 1 tokens and kept 2, 0 and 1: position 1 was drafted
    3 times and kept twice (0.6667), position 2 drafted twice and kept once (0.5) -> ``[0.6667, 0.5]``.
    """
    drafted, kept = [0] * longest, [0] * longest
    for r in runs:
        for hist, into in ((r.get("draft_lengths"), drafted), (r.get("accept_hist"), kept)):
            for k, count in (hist or {}).items():
                for i in range(min(int(k), longest)):
                    into[i] += count
    return [round(a / d, 4) for a, d in zip(kept, drafted) if d]


def _fields(mine: list[dict], ref: list[dict]) -> dict:
    tps = _mean(r["tokens_per_s"] for r in mine)
    ref_tps = _mean(r["tokens_per_s"] for r in ref)
    stepped = [r for r in mine if r.get("steps") is not None]
    steps = sum(r["steps"] for r in stepped)
    drafted = sum(r.get("drafted") or 0 for r in stepped)
    accepted = sum(r.get("accepted") or 0 for r in stepped)
    differing = [r["id"] for r in mine if r.get("identical") is False]
    compared = [r for r in mine if r.get("identical") is not None]  # methods on other weights are not
    agreement = [r["agreement"] for r in mine if r.get("agreement") is not None]
    draft_s = sum(r.get("draft_time_s") or 0.0 for r in stepped)
    agg, ref_agg = _aggregate(mine), _aggregate(ref)
    ttft = _mean(r["ttft_s"] for r in mine if r.get("ttft_s") is not None)
    turns = sorted({r["turn"] for r in mine if r.get("turn") is not None})
    by_turn = {str(t): round(_mean(r["ttft_s"] for r in mine if r.get("turn") == t and r.get("ttft_s") is not None)
                             or 0.0, 5) for t in turns}
    return {
        "prompts": len(mine),
        "tokens_per_s": round(tps, 3) if tps is not None else None,
        "speedup": round(tps / ref_tps, 4) if tps is not None and ref_tps else None,
        "speedup_interval": speedup_interval(mine, ref),
        "aggregate_tokens_per_s": round(agg, 3) if agg is not None else None,
        "aggregate_speedup": round(agg / ref_agg, 4) if agg is not None and ref_agg else None,
        "mean_accepted_tokens": round((accepted + steps) / steps, 4) if steps else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else (0.0 if stepped else None),
        "position_acceptance": position_acceptance(stepped),
        # drafting time per drafted token (a layer-skip draft forward; near 0 for prompt lookup)
        "draft_ms_per_token": round(1e3 * draft_s / drafted, 3) if drafted else None,
        "identical_to_ar": (not differing) if compared else None,
        # other weights (llama.cpp): mean leading tokens equal to ar's output
        "agreement_tokens": round(_mean(agreement), 2) if agreement else None,
        "differing_prompts": differing,
        "lossless_violations": sum(1 for r in mine if r.get("violation")),
        # time to the first token (the prefill's; None where the method does not say), mean over the runs,
        # and by turn (a conversation's, or a shared text's questions: `bench --all-turns`, `--shared-context`)
        "ttft_s": round(ttft, 5) if ttft is not None else None,
        "ttft_by_turn": by_turn,
        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in mine),
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in mine),
    }


def markdown(summary: dict, methods: list[str], sampled: bool = False) -> str:
    """A table: one row per group (then overall), a ``speedup [interval] (tok/s)`` cell per method
    (the interval where it has a width: not the reference's own), and the acceptance /
    tokens-per-step and equality figures below it (``sampled``: a sampled run's, compared by no identity)."""
    groups = sorted({g for m in methods for g in summary[m]["by_category"]})
    head = "| group | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods) + "\n"
    lines = []
    for g in [*groups, "overall"]:
        cells = []
        for m in methods:
            f = summary[m] if g == "overall" else summary[m]["by_category"].get(g)
            iv = (f or {}).get("speedup_interval")
            spread = f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv and iv[0] != iv[1] else ""
            cells.append("-" if not f or f["speedup"] is None
                         else f"{f['speedup']:.2f}x{spread} ({f['tokens_per_s']:.1f})")
        name = "**overall**" if g == "overall" else g
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    detail = ["",
              "| method | aggregate tok/s (over ar) | mean accepted tokens | acceptance rate | kept by position "
              "| draft ms/token | identical to ar | lossless violations |",
              "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        f = summary[m]
        mat = "-" if f["mean_accepted_tokens"] is None else f"{f['mean_accepted_tokens']:.2f}"
        acc = "-" if f["acceptance_rate"] is None else f"{f['acceptance_rate']:.2f}"
        same = "yes" if f["identical_to_ar"] else f"no ({len(f['differing_prompts'])} prompts)"
        if f["identical_to_ar"] is None:
            same = "other weights" + (f": first {f['agreement_tokens']:.0f} tokens agree on average"
                                      if f.get("agreement_tokens") is not None else "")
            if sampled:
                same = "sampled: the distribution tests"
        dms = "-" if f.get("draft_ms_per_token") is None else f"{f['draft_ms_per_token']:.2f}"
        agg = ("-" if f.get("aggregate_tokens_per_s") is None else f"{f['aggregate_tokens_per_s']:.1f}"
               + (f" ({f['aggregate_speedup']:.2f}x)" if f.get("aggregate_speedup") is not None else ""))
        pos = "/".join(f"{a:.2f}" for a in (f.get("position_acceptance") or [])[:4]) or "-"
        violations = "-" if sampled else f["lossless_violations"]  # sampled: no audit ran
        detail.append(f"| {m} | {agg} | {mat} | {acc} | {pos} | {dms} | {same} | {violations} |")
    turns = sorted({t for m in methods for t in summary[m].get("ttft_by_turn") or {}}, key=int)
    if len(turns) > 1:  # conversations or shared texts: what the prefix caches saved at the first token
        detail += ["", "| method | " + " | ".join(f"TTFT turn {t} (s)" for t in turns)
                   + " | later turns / first | prompt tokens cached |", "|---|" + "---|" * (len(turns) + 2)]
        for m in methods:
            f = summary[m]
            by = f.get("ttft_by_turn") or {}
            cells = [f"{by[t]:.3f}" if by.get(t) else "-" for t in turns]
            later = [by[t] for t in turns[1:] if by.get(t)]
            ratio = f"{_mean(later) / by[turns[0]]:.3f}" if later and by.get(turns[0]) else "-"
            share = f"{f['cached_tokens']} of {f['prompt_tokens']}" if f.get("prompt_tokens") else "-"
            detail.append(f"| {m} | " + " | ".join(cells) + f" | {ratio} | {share} |")
    return head + "\n".join(lines) + "\n" + "\n".join(detail) + "\n"


def plot(summary: dict, methods: list[str], path, title: str = "") -> None:
    """Bar chart of speedup over ``ar`` per group (and overall), one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in methods if m != REFERENCE]
    groups = sorted({g for m in shown for g in summary[m]["by_category"]}) + ["overall"]
    width = 0.8 / max(1, len(shown))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) + 2), 4.2))
    for i, m in enumerate(shown):
        vals = [(summary[m] if g == "overall" else summary[m]["by_category"].get(g, {})).get("speedup") or 0.0
                for g in groups]
        xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylabel("speedup over ar (tokens/s ratio)")
    ax.set_title(title or "speedup per group")
    ax.legend(fontsize=8, ncol=min(4, len(shown)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
