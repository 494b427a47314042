"""The acceptance vs draft-cost frontier of layer skipping, one panel per domain, as a PNG.

Each point is one skip set a calibration scored (its search's trials, ``trials-<domain>.jsonl`` in
the calibration's work directory, which a finished calibration removes: copy them while it runs,
or run with a kept copy). The x axis is the draft's cost in decoding steps (the cost model), the y
axis its teacher-forced per-token acceptance. Two curves per panel, from the same formula the
search scores with (:func:`adaptive.costs.acceptance_needed` at the profile's verification costs):

* *break-even*: the acceptance a draft of that cost needs to reach 1.0x plain decoding;
* *reference*: the acceptance it needs to reach the domain's statistical drafters (the bound's
  reference, ``layer_skip.reference`` in the profile), what layer skipping must beat to be chosen.

A point above a curve pays against it. The best skip set the search kept is circled.

    python benchmarks/frontier_plot.py PROFILE_DIR TRIALS_DIR OUT.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaptive.calibrate.settings import GLOBAL_TASK
from adaptive.costs import acceptance_needed
from adaptive.profile import GLOBAL, load_profile
from adaptive.workdir import slug


def read_trials(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("trials", type=Path, help="directory holding trials-<domain>.jsonl")
    ap.add_argument("out", type=Path)
    ap.add_argument("--title", default="")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = load_profile(args.profile)
    max_len = profile.runtime.max_draft_len
    verify = profile.cost_model.verify_table(max_len)
    records = [(name, rec, name) for name, rec in sorted(profile.domains.items())]
    records.append((GLOBAL, profile.global_set, GLOBAL_TASK))  # the global task's trials file
    cols = 4
    rows = -(-len(records) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.4 * rows), sharex=True, sharey=True, squeeze=False)
    costs = [i / 100 for i in range(5, 101)]
    for ax, (name, rec, stem) in zip(axes.flat, records):
        trials = [t for t in read_trials(args.trials / f"trials-{slug(stem)}.jsonl")
                  if t.get("n_attn", 0) + t.get("n_mlp", 0) > 0]
        ax.scatter([t["draft_cost"] for t in trials], [t["matchness"] for t in trials], s=14, alpha=0.7,
                   label=f"skip sets scored ({len(trials)})")
        ax.plot(costs, [acceptance_needed(1.0, c, verify, max_len) for c in costs], "k--", lw=1, label="break-even")
        ref = rec.layer_skip.reference
        if ref:
            ax.plot(costs, [acceptance_needed(ref, c, verify, max_len) for c in costs], "r-", lw=1,
                    label=f"statistical reference {ref:.2f}x")
        ls = rec.layer_skip
        if ls.skip.size:
            ax.scatter([ls.estimated_draft_cost], [ls.estimated_acceptance], s=90, facecolors="none",
                       edgecolors="g", label=f"kept: {ls.estimated_speedup:.2f}x est.")
        ax.set_title(f"{name}: {rec.decision.drafter}", fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(records):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("draft cost (decoding steps)")
    for ax in axes[:, 0]:
        ax.set_ylabel("acceptance per token")
    fig.suptitle(args.title or f"Layer-skipping frontier: {profile.model.name}")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
