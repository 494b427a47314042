"""Which prompt embedding routes best: layer, pooling, whitening, anchors, k, out-of-domain margin.

    python benchmarks/routing_study.py ../shared/data/spec_bench_dev.jsonl --calib 16 --features /tmp/rs.npz
    python benchmarks/routing_study.py ../shared/data/spec_bench_dev.jsonl --engine llama.cpp --features /tmp/rs-cpp.npz

Every prompt of a Spec-Bench-format file is prefilled once (as calibration encodes it) and its
final-normed residual stream is pooled after several layers, as the mean over positions and at
the last position (``Backbone.forward(pool_layers=...)``; on ``--engine llama.cpp`` from
llama.cpp's layer-input rows, and after the last layer only the last position, the embedding
that engine gives there); the features are cached in ``--features``. Then, offline, each
configuration builds an :class:`~adaptive.index.anchors.AnchorIndex` from the first
``--calib`` prompts of each group and routes the rest; accuracy is over the groups other than
MT-bench (an out-of-domain decision counts as wrong), as in ``benchmarks/routing_eval.py``. A
second pass leaves MT-bench out of the calibration and counts how many of its prompts are
flagged out-of-domain. Prints one line per configuration, best first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from adaptive.bench.data import group_of
from adaptive.index.anchors import AnchorIndex

HELD_OUT_EXCLUDED = "mt_bench"


def features(path: Path, cache: Path, layers: list[int], engine_name: str = "torch"
             ) -> tuple[dict[str, np.ndarray], list[str]]:
    """``{f"{layer}/{mean|last}": [n, hidden]}`` and each prompt's group, cached at ``cache``."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    groups = [group_of(r["category"]) for r in rows]
    if cache.exists():
        data = np.load(cache)
        same_engine = str(data["engine"]) == engine_name if "engine" in data else engine_name == "torch"
        if same_engine and all(f"{layer}/last" in data for layer in layers) and \
                len(data[f"{layers[0]}/last"]) == len(rows):
            return {k: data[k] for k in data.files if k != "engine"}, groups
    import torch

    from adaptive.engine.engine import Engine
    from adaptive.models import load_model

    lm = load_model("smollm2-135m", engine=engine_name)
    engine, bb = Engine(lm), lm.backbone
    # llama.cpp: the final layer's last position is its own embedding (a decode of the last token)
    final = [layer for layer in layers if layer == bb.n_layers] if lm.engine == "llama.cpp" else []
    inner = tuple(layer for layer in layers if layer not in final)
    out: dict[str, list] = defaultdict(list)
    t0 = time.perf_counter()
    for i, r in enumerate(rows):
        ids = engine.encode(r["turns"][0])
        res = bb.forward(torch.tensor(ids), bb.new_cache(len(ids)), 0, logits="last" if final else "none",
                         pool_layers=inner, **({"pool_last": True} if final else {}))
        for layer, v in res.layer_pools.items():
            out[f"{layer}/mean"].append(v[0].numpy())
            out[f"{layer}/last"].append(v[1].numpy())
        for layer in final:
            out[f"{layer}/last"].append(res.pooled.numpy())
        if i % 48 == 47:
            print(f"  {i + 1}/{len(rows)} prompts embedded ({time.perf_counter() - t0:.0f} s)", flush=True)
    feats = {k: np.stack(v).astype(np.float32) for k, v in out.items()}
    np.savez(cache, **feats, engine=np.array(engine_name))  # features of another engine are not reused
    return feats, groups


def whitening(x: np.ndarray, dims: int | None) -> tuple[np.ndarray, np.ndarray]:
    """PCA whitening fitted on ``x`` (unit rows): ``(mean, projection [d, dims])``; ``dims=None``: identity."""
    mean = x.mean(axis=0)
    if dims is None:
        return np.zeros_like(mean), np.eye(x.shape[1], dtype=np.float32)
    u, s, vt = np.linalg.svd(x - mean, full_matrices=False)
    scale = s[:dims] / np.sqrt(max(len(x) - 1, 1))
    return mean, (vt[:dims].T / np.maximum(scale, 1e-6)).astype(np.float32)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def evaluate(x: np.ndarray, groups: list[str], calib: int, dims: int | None, anchors: int, k: int, margin: float,
             calibrated: set[str]) -> dict:
    by_group = defaultdict(list)
    for i, g in enumerate(groups):
        by_group[g].append(i)
    train = {g: idx[:calib] for g, idx in by_group.items() if g in calibrated}
    fit = unit(x[[i for idx in train.values() for i in idx]])
    mean, proj = whitening(fit, dims)

    def embed(rows):
        return (unit(x[rows]) - mean) @ proj

    index = AnchorIndex.build({g: embed(idx) for g, idx in train.items()}, per_domain=anchors, k=k, ood_margin=margin)
    ok = total = 0
    flagged_outside = 0
    outside = 0
    per_group = {}
    for g, idx in sorted(by_group.items()):
        held = idx[calib:] if g in calibrated else idx
        hits = 0
        for v in embed(held):
            r = index.route(v)
            if g in calibrated:
                hits += r.domain == g
            else:
                flagged_outside += r.out_of_domain
        if g in calibrated:
            per_group[g] = (hits, len(held))
            if g != HELD_OUT_EXCLUDED:
                ok, total = ok + hits, total + len(held)
        else:
            outside += len(held)
    return {"accuracy": ok / max(total, 1), "correct": ok, "total": total, "per_group": per_group,
            "ood_flagged": flagged_outside, "ood_total": outside}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--features", type=Path, default=Path("routing-features.npz"))
    ap.add_argument("--layers", default="6,10,14,18,22,26,30")
    ap.add_argument("--json", dest="json_out", type=Path, default=None)
    ap.add_argument("--engine", default="torch", choices=("torch", "llama.cpp"))
    args = ap.parse_args()
    layers = [int(v) for v in args.layers.split(",")]
    feats, groups = features(args.data, args.features, layers, args.engine)
    every = set(groups)
    results = []
    grid = itertools.product(layers, ("mean", "last"), (None, 16, 32, 64), (4, 10, 16), (1, 3, 5))
    for layer, pool, dims, anchors, k in grid:
        if f"{layer}/{pool}" not in feats:  # llama.cpp: no mean after the last layer
            continue
        x = feats[f"{layer}/{pool}"]
        r = evaluate(x, groups, args.calib, dims, anchors, k, 1.25, every)
        results.append({"layer": layer, "pool": pool, "whiten": dims, "anchors": anchors, "k": k, **r})
    results.sort(key=lambda r: (-r["accuracy"], r["layer"] != 30, r["whiten"] is not None))
    print(f"{'layer':>5} {'pool':>4} {'whiten':>6} {'anch':>4} {'k':>2}  accuracy   per group")
    for r in results[:25]:
        per = " ".join(f"{g[:5]} {h}/{n}" for g, (h, n) in r["per_group"].items() if g != HELD_OUT_EXCLUDED)
        print(f"{r['layer']:>5} {r['pool']:>4} {str(r['whiten']):>6} {r['anchors']:>4} {r['k']:>2}  "
              f"{r['accuracy']:.3f} ({r['correct']}/{r['total']})  {per}")
    default = (30, "mean" if "30/mean" in feats else "last", None, 10, 5)
    base = next(r for r in results if (r["layer"], r["pool"], r["whiten"], r["anchors"], r["k"]) == default)
    print(f"\nthe last layer (30, {default[1]}, no whitening, 10 anchors, k 5): {base['accuracy']:.3f}")
    # out-of-domain: MT-bench left out of the calibration, for the best configuration and the default
    ood = []
    for r in (results[0], base):
        for margin in (1.0, 1.1, 1.25, 1.5):
            o = evaluate(feats[f"{r['layer']}/{r['pool']}"], groups, args.calib, r["whiten"], r["anchors"], r["k"],
                         margin, every - {HELD_OUT_EXCLUDED})
            ood.append({"config": {k: r[k] for k in ("layer", "pool", "whiten", "anchors", "k")}, "margin": margin,
                        **o})
            print(f"without MT-bench, layer {r['layer']} {r['pool']} whiten {r['whiten']} margin {margin}: "
                  f"{o['ood_flagged']}/{o['ood_total']} MT-bench prompts flagged out-of-domain, "
                  f"accuracy on the others {o['accuracy']:.3f}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"results": results, "ood": ood}, indent=1, default=str))


if __name__ == "__main__":
    main()
