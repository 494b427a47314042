"""Speed per group and along the request stream of an ``adaptive bench`` report, as a PNG.

Made for a mixed-domain stream (``adaptive bench --order mixed``, KNN-SSD's evaluation), it reads
any bench report. One figure, two panels:

* (a) speedup over the baseline per group, one bar per method, and ``overall``: the report's own
  aggregation (:func:`adaptive.bench.report.summarize`: mean tokens/s over the group's prompts,
  over the baseline's same mean), a dashed line at 1.0;
* (b) the stream: for each method, cumulative new tokens / cumulative seconds after each request,
  in the report's run order (the stream order), a tick per request coloured by its group. A run's
  seconds are ``new_tokens / tokens_per_s``: the whole call, prefill included, as bench times it.

The same numbers are printed as a text table.

    python benchmarks/mixed_stream_plot.py REPORT.json OUT.png [--baseline ar]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaptive.bench.report import REFERENCE, summarize


class ReportError(Exception):
    """A report that cannot be drawn: one line for the user."""


def read_report(path: Path, baseline: str) -> dict:
    """The report as a dict, checked for what the plot needs (runs with the baseline among them)."""
    if not path.is_file():
        raise ReportError(f"no such report file: {path}")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: not a JSON report ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("runs"), list) or not report["runs"]:
        raise ReportError(f"{path}: no runs (an `adaptive bench` report has a non-empty \"runs\" list)")
    if baseline not in methods_of(report):
        raise ReportError(f"{path}: the report has no runs of the baseline method {baseline!r} "
                          f"(methods: {', '.join(methods_of(report))}); pass --baseline METHOD")
    return report


def methods_of(report: dict) -> list[str]:
    """The report's methods in its own order (its ``methods`` header, else first appearance in the runs),
    those with runs only."""
    ran = {r["method"] for r in report["runs"]}
    order = [m for m in report.get("methods") or {} if m in ran]
    return order + [m for m in dict.fromkeys(r["method"] for r in report["runs"]) if m not in order]


def speedups(report: dict, baseline: str) -> tuple[list[str], dict[str, dict[str, float | None]]]:
    """``(groups + ["overall"], {method: {group: speedup}})`` over ``baseline``, by the report's
    aggregation (:func:`~adaptive.bench.report.summarize`)."""
    methods = methods_of(report)
    summary = summarize(report["runs"], methods, reference=baseline)
    groups = sorted({g for m in methods for g in summary[m]["by_category"]})
    table = {m: {g: (summary[m]["by_category"].get(g) or {}).get("speedup") for g in groups} for m in methods}
    for m in methods:
        table[m]["overall"] = summary[m]["speedup"]
    return [*groups, "overall"], table


def cumulative_speed(runs: list[dict], method: str) -> list[float | None]:
    """After each of ``method``'s runs, in stream order: total new tokens / total seconds so far
    (``None`` while no time has passed). A run's seconds: ``new_tokens / tokens_per_s`` (0 for a run
    with no tokens).

    Example: runs of 10 tokens at 10 tok/s (1 s), 30 at 15 (2 s), 0 tokens: ``[10.0, 13.333, 13.333]``.
    """
    tokens = seconds = 0.0
    out: list[float | None] = []
    for r in runs:
        if r["method"] != method:
            continue
        n, tps = r.get("new_tokens") or 0, r.get("tokens_per_s") or 0.0
        tokens += n
        seconds += n / tps if n and tps > 0 else 0.0
        out.append(tokens / seconds if seconds > 0 else None)
    return out


def stream_groups(runs: list[dict], method: str) -> list[str]:
    """The group of each of ``method``'s requests, in stream order."""
    return [r["group"] for r in runs if r["method"] == method]


def text_table(groups: list[str], table: dict, streams: dict[str, list[float | None]], baseline: str) -> str:
    """Speedup per group (then overall) and method; then cumulative tok/s at a quarter, half,
    three quarters and the end of the stream."""
    def cell(x, fmt):
        return "-" if x is None else fmt.format(x)

    methods = list(table)
    w = max(len(m) for m in [*methods, "method", "10.00x"]) + 2  # a column per method
    gw = max(len(g) for g in [*groups, "group"]) + 2
    lines = [f"speedup over {baseline} (mean tokens/s over the group's prompts / {baseline}'s)",
             "group".ljust(gw) + "".join(m.rjust(w) for m in methods)]
    lines += [g.ljust(gw) + "".join(cell(table[m][g], "{:.2f}x").rjust(w) for m in methods) for g in groups]
    n = max((len(s) for s in streams.values()), default=0)
    marks = sorted({max(1, round(n * q)) for q in (0.25, 0.5, 0.75, 1.0)}) if n else []
    lines += ["", "cumulative tokens/s along the stream, after request",
              "method".ljust(w) + "".join(f"{k}/{n}".rjust(10) for k in marks)]
    for m, s in streams.items():
        lines.append(m.ljust(w) + "".join(cell(s[k - 1] if k <= len(s) else None, "{:.1f}").rjust(10) for k in marks))
    return "\n".join(lines)


def draw(report: dict, baseline: str, groups: list[str], table: dict, streams: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in table if m != baseline]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(max(12.0, 1.2 * len(groups) + 8), 4.6),
                                 gridspec_kw={"width_ratios": [max(1.0, len(groups) / 4), 1.4]})
    width = 0.8 / max(1, len(shown))
    for i, m in enumerate(shown):
        xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, [table[m][g] or 0.0 for g in groups], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right")
    ax.set_ylabel(f"speedup over {baseline} (tokens/s ratio)")
    ax.set_title("(a) speedup per group")
    if shown:
        ax.legend(fontsize=8, ncol=min(4, len(shown)))

    for m, s in streams.items():
        style = {"color": "black", "linestyle": "--", "linewidth": 1.0} if m == baseline else {"linewidth": 1.4}
        bx.plot(range(1, len(s) + 1), [float("nan") if v is None else v for v in s], label=m, **style)
    seq = stream_groups(report["runs"], baseline)
    colours = {g: plt.get_cmap("Dark2")(i % 8) for i, g in enumerate(sorted(set(seq)))}  # not the lines' tab10
    bx.scatter(range(1, len(seq) + 1), [0.02] * len(seq), c=[colours[g] for g in seq], marker="|", s=80,
               transform=bx.get_xaxis_transform(), clip_on=False)
    for g, c in colours.items():  # legend entries for the group ticks
        bx.scatter([], [], color=c, marker="|", s=80, label=f"group {g}")
    bx.set_xlabel("request in stream order")
    bx.set_ylabel("cumulative new tokens / cumulative seconds")
    bx.set_title(f"(b) speed along the stream ({(report.get('settings') or {}).get('order', 'file')} order)")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7, ncol=2)
    model = report.get("model") or {}
    settings = report.get("settings") or {}
    fig.suptitle(f"{model.get('name', '?')} ({model.get('dtype', '?')}), {settings.get('prompts', len(seq))} requests, "
                 f"{settings.get('max_new_tokens', '?')} new tokens")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="report.json from adaptive bench")
    ap.add_argument("out", type=Path, help="the PNG to write")
    ap.add_argument("--baseline", default=REFERENCE, help=f"the method speedups are over (default {REFERENCE})")
    args = ap.parse_args(argv)
    try:
        report = read_report(args.report, args.baseline)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    groups, table = speedups(report, args.baseline)
    streams = {m: cumulative_speed(report["runs"], m) for m in table}
    print(text_table(groups, table, streams, args.baseline))
    draw(report, args.baseline, groups, table, streams, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
