"""Domain anchors: FAISS k-means centroids of prompt embeddings, searched to route a request.

Routing policy (KNN-SSD's, made explicit):

1. the request's pooled embedding is L2-normalised (:meth:`AnchorIndex.transform`; optionally
   centred on the calibration mean first), as the anchors were;
2. the ``k`` nearest anchors are found (exact L2 search, ``faiss.IndexFlatL2``);
3. each neighbour votes for its domain with weight ``1 / (distance + eps)`` (:func:`vote`);
4. if even the nearest anchor is farther than its domain's radius (``ood_thresholds``, learnt at
   calibration: a margin over the largest leave-one-out distance of that domain's calibration
   prompts to its anchors), the request is out-of-domain and the runtime uses the global record.
   A radius per domain, because domains differ in spread: on Spec-Bench a diverse group
   (MT-bench) reaches 3-4x the leave-one-out distance of a tight one (QA), and one threshold for
   all let a left-out group hide near the tight ones (docs/history/2026-11-24-online-adaptation.md).
   Indexes saved before per-domain radii use the single ``ood_threshold`` (the largest radius) for
   every domain.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adaptive.engine.config import Pooling
from adaptive.errors import AdaptiveError

EPS = 1e-6


class IndexFileError(AdaptiveError, ValueError):
    """An anchor index on disk is missing, truncated, corrupt or inconsistent."""


def vote(labels: list[str], distances: list[float], eps: float = EPS) -> tuple[str, dict[str, float]]:
    """Distance-weighted vote: each neighbour adds ``1 / (d + eps)`` to its label's score.

    Returns the winning label and the normalised scores. Ties go to the label of the nearer
    neighbour (labels are visited nearest first).

    Example: labels ``["math", "code", "code"]`` at distances ``[0.1, 0.3, 0.3]`` score
    math ``10``, code ``3.33 + 3.33 = 6.67``: ``math`` wins with share 0.6.
    """
    if not labels or len(labels) != len(distances):
        raise ValueError("need as many labels as distances, at least one")
    scores: dict[str, float] = defaultdict(float)
    for lab, d in zip(labels, distances):
        scores[lab] += 1.0 / (max(float(d), 0.0) + eps)
    best = max(scores, key=lambda lab: (scores[lab], -labels.index(lab)))
    total = sum(scores.values())
    return best, {lab: s / total for lab, s in scores.items()}


def kmeans_anchors(vectors: np.ndarray, k: int, seed: int = 0, niter: int = 25) -> np.ndarray:
    """``[n, d]`` unit vectors -> ``[min(k, n), d]`` unit-length centroids (``faiss.Kmeans``).

    With ``k >= n`` every vector is its own anchor (k-means would only reproduce them).
    """
    import faiss

    n = vectors.shape[0]
    if n == 0:
        raise ValueError("no vectors to cluster")
    k = min(k, n)
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    if k == n:
        cent = x.copy()
    else:
        km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=int(seed) + 1, verbose=False, min_points_per_centroid=1)
        km.train(x)
        cent = km.centroids.copy()
    return _unit(cent)


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(norm, 1e-12)).astype(np.float32)


@dataclass(frozen=True)
class Route:
    """A routing decision: ``domain`` is ``None`` when the request is out-of-domain."""

    domain: str | None
    nearest_domain: str
    neighbours: tuple[tuple[str, float], ...]  # (domain, distance), nearest first
    scores: dict
    out_of_domain: bool

    def to_dict(self) -> dict:
        return {"domain": self.domain, "nearest_domain": self.nearest_domain, "out_of_domain": self.out_of_domain,
                "neighbours": [{"domain": d, "distance": round(x, 5)} for d, x in self.neighbours],
                "scores": {k: round(v, 4) for k, v in self.scores.items()}}


class AnchorIndex:
    """Anchors ``[K, d]`` (unit length) with a domain label each, in a FAISS index."""

    FILES = ("anchors.faiss", "anchors.json", "embedding_mean.npy")

    def __init__(self, anchors: np.ndarray, labels: list[str], mean: np.ndarray, ood_threshold: float, k: int = 5,
                 pooling: Pooling | None = None, ood_thresholds: dict[str, float] | None = None):
        import faiss

        if anchors.ndim != 2 or anchors.shape[0] != len(labels) or anchors.shape[0] == 0:
            raise ValueError("anchors must be [K, d] with one label per row, K >= 1")
        if mean.shape != (anchors.shape[1],):
            raise ValueError(f"mean has shape {mean.shape}, expected ({anchors.shape[1]},)")
        self.anchors = np.ascontiguousarray(anchors, dtype=np.float32)
        self.labels = list(labels)
        self.mean = mean.astype(np.float32)
        self.ood_threshold = float(ood_threshold)
        self.ood_thresholds = {str(d): float(t) for d, t in (ood_thresholds or {}).items()}
        unknown = set(self.ood_thresholds) - set(self.labels)
        if unknown:
            raise ValueError(f"out-of-domain radii for domains without anchors: {sorted(unknown)}")
        self.k = int(k)
        self.pooling = pooling or Pooling()  # how the prompts' embeddings were taken (route with the same)
        self.index = faiss.IndexFlatL2(self.anchors.shape[1])
        self.index.add(self.anchors)

    @property
    def dim(self) -> int:
        return self.anchors.shape[1]

    @property
    def domains(self) -> list[str]:
        return sorted(set(self.labels))

    def threshold(self, domain: str) -> float:
        """The out-of-domain radius of ``domain`` (squared L2): its own, else the index's single threshold."""
        return self.ood_thresholds.get(domain, self.ood_threshold)

    def transform(self, vectors: np.ndarray) -> np.ndarray:
        """Raw pooled embeddings ``[d]`` or ``[n, d]`` -> unit-length ``[n, d]`` (minus ``mean`` first)."""
        x = np.atleast_2d(np.asarray(vectors, dtype=np.float32))
        if x.shape[1] != self.dim:
            raise IndexFileError(f"embedding has dimension {x.shape[1]} but the index has {self.dim}")
        return _unit(x - self.mean)

    @classmethod
    def build(cls, embeddings: dict[str, np.ndarray], per_domain: int = 10, seed: int = 0, k: int = 5,
              ood_margin: float = 1.25, center: bool = False, pooling: Pooling | None = None) -> AnchorIndex:
        """Cluster each domain's raw embeddings (``{domain: [n, d]}``) into at most ``per_domain`` anchors.

        Each domain's out-of-domain radius is ``ood_margin`` times the largest leave-one-out
        distance of its prompts: for each calibration prompt, its distance to the nearest anchor of
        its own domain clustered *without* it (a prompt is always close to anchors fitted on
        itself); ``ood_threshold`` is the largest radius (a domain of one prompt gets it).
        ``center`` subtracts the calibration mean before normalising (measured slightly worse on
        Spec-Bench with the embedded model, so off by default; see docs/profile.md). ``pooling``:
        how the embeddings were taken, recorded so that routing takes them the same way.
        """
        if not embeddings:
            raise ValueError("no domains to index")
        dim = next(iter(embeddings.values())).shape[1]
        mean = (np.concatenate(list(embeddings.values())).mean(axis=0) if center else np.zeros(dim)).astype(np.float32)
        anchors, labels, worst = [], [], {}
        for i, (name, raw) in enumerate(sorted(embeddings.items())):
            x = _unit(np.asarray(raw, dtype=np.float32) - mean)
            cent = kmeans_anchors(x, per_domain, seed=seed * 1009 + i)
            anchors.append(cent)
            labels += [name] * len(cent)
            for j in range(len(x)) if len(x) > 1 else ():
                rest = np.delete(x, j, axis=0)
                c = kmeans_anchors(rest, min(per_domain, len(rest)), seed=seed * 1009 + i)
                worst[name] = max(worst.get(name, 0.0), float(((c - x[j]) ** 2).sum(-1).min()))
        radii = {name: max(w * ood_margin, 1e-4) for name, w in worst.items()}
        return cls(np.concatenate(anchors), labels, mean, ood_threshold=max(radii.values(), default=1e-4), k=k,
                   pooling=pooling, ood_thresholds=radii)

    def search(self, vectors: np.ndarray, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Squared L2 distances and anchor indices, ``[n, k]`` each, nearest first.

        A single query runs on one OpenMP thread: with 10,000 anchors FAISS's thread fan-out
        made one search 4x slower (2.1 ms against 0.5 ms on 2 cores; benchmarks/routing_overhead.py).
        """
        import faiss

        k = min(k or self.k, len(self.labels))
        x = self.transform(vectors)
        if x.shape[0] > 1:
            return self.index.search(x, k)
        before = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)  # per calling thread (OpenMP semantics)
        try:
            return self.index.search(x, k)
        finally:
            faiss.omp_set_num_threads(before)

    def route(self, vector: np.ndarray, k: int | None = None) -> Route:
        """Route one raw embedding ``[d]`` (see the module docstring for the policy)."""
        dist, idx = self.search(vector, k)
        labs = [self.labels[j] for j in idx[0]]
        ds = [float(x) for x in dist[0]]
        winner, scores = vote(labs, ds)
        ood = ds[0] > self.threshold(labs[0])
        return Route(None if ood else winner, labs[0], tuple(zip(labs, ds)), scores, ood)

    # -- persistence ---------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        import faiss

        directory = Path(directory)
        faiss.write_index(self.index, str(directory / "anchors.faiss"))
        np.save(directory / "embedding_mean.npy", self.mean)
        meta = {"labels": self.labels, "ood_threshold": self.ood_threshold, "k": self.k, "dim": self.dim,
                "pooling": self.pooling.to_dict(), "ood_thresholds": self.ood_thresholds}
        (directory / "anchors.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> AnchorIndex:
        """Load and check an index; every problem is an :class:`IndexFileError` naming the file."""
        import faiss

        directory = Path(directory)
        for name in cls.FILES:
            if not (directory / name).is_file():
                raise IndexFileError(f"{directory / name}: missing from the profile")
        try:
            meta = json.loads((directory / "anchors.json").read_text(encoding="utf-8"))
            labels, thr, k = list(meta["labels"]), float(meta["ood_threshold"]), int(meta["k"])
            pooling = Pooling.from_dict(meta.get("pooling", {}))  # absent before issue 17: the final mean
            radii = {str(d): float(t) for d, t in meta.get("ood_thresholds", {}).items()}  # absent before issue 20
        except (ValueError, KeyError, TypeError, AdaptiveError) as exc:
            raise IndexFileError(f"{directory / 'anchors.json'}: unreadable ({exc})") from None
        try:
            mean = np.load(directory / "embedding_mean.npy", allow_pickle=False)
        except Exception as exc:  # numpy raises several types for a damaged file
            raise IndexFileError(f"{directory / 'embedding_mean.npy'}: unreadable ({exc})") from None
        try:
            index = faiss.read_index(str(directory / "anchors.faiss"))
            anchors = index.reconstruct_n(0, index.ntotal)
        except Exception as exc:  # faiss raises RuntimeError with its C++ message
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise IndexFileError(f"{directory / 'anchors.faiss'}: not a readable FAISS index ({first})") from None
        if index.ntotal != len(labels):
            raise IndexFileError(f"{directory / 'anchors.faiss'}: {index.ntotal} anchors but {len(labels)} labels")
        if mean.ndim != 1 or mean.shape[0] != index.d:
            raise IndexFileError(f"{directory / 'embedding_mean.npy'}: dimension does not match the index ({index.d})")
        try:
            return cls(np.asarray(anchors), labels, mean, thr, k, pooling, radii)
        except ValueError as exc:
            raise IndexFileError(f"{directory / 'anchors.json'}: {exc}") from None
