"""Finding a new domain among requests the index flags out-of-domain: :func:`find_cluster`, the
online learner's clustering (:mod:`adaptive.runtime.online`), built on the index's k-means
(:func:`~adaptive.index.anchors.kmeans_anchors`) and calibration's leave-one-out test of anchors.
"""

from __future__ import annotations

import numpy as np

from adaptive.index.anchors import kmeans_anchors


def find_cluster(x: np.ndarray, threshold: float, min_size: int, per_domain: int, coherence: float,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """A coherent group among ``x`` (``[n, d]`` unit vectors, as the index transforms them):
    ``(member indices, anchors [m, d])`` or ``None``.

    For ``c = 1 .. n // min_size``, FAISS k-means splits ``x`` into ``c`` clusters. In each cluster
    (largest first) the *core* is the members within ``threshold`` (squared L2: the index's
    out-of-domain threshold) of another member. A core of at least ``min_size`` members passes
    when at least ``coherence`` of them lie within ``threshold`` of anchors fitted *without* them
    (the calibration's leave-one-out test: requests like these would route to the new domain rather
    than be flagged again). Its anchors: at most ``per_domain`` k-means centroids of the core.

    Example: 8 copies of one direction plus small noise, ``threshold`` above the noise: one
    cluster, all 8 in its core, each within the threshold of anchors fitted on the other 7: all 8
    with their anchors. Eight unrelated directions: no member is near another: ``None``. The 8
    among 5 unrelated ones: the 5 fall outside the core; the 8 again.
    """
    import faiss

    n = x.shape[0]
    x = np.ascontiguousarray(x, dtype=np.float32)
    for c in range(1, n // min_size + 1):
        if c == 1:
            assign = np.zeros(n, dtype=np.int64)
        else:
            km = faiss.Kmeans(x.shape[1], c, niter=20, seed=seed + c, verbose=False, min_points_per_centroid=1)
            km.train(x)
            assign = km.index.search(x, 1)[1][:, 0]
        sizes = np.bincount(assign, minlength=c)
        for j in np.argsort(-sizes, kind="stable"):
            if sizes[j] < min_size:
                break
            idx = np.flatnonzero(assign == j)
            d2 = ((x[idx, None, :] - x[None, idx, :]) ** 2).sum(-1)
            np.fill_diagonal(d2, np.inf)
            idx = idx[d2.min(axis=1) <= threshold]
            if len(idx) < min_size:
                continue
            core = x[idx]
            within = 0
            for i in range(len(idx)):
                anchors = kmeans_anchors(np.delete(core, i, axis=0), per_domain, seed=seed)
                within += float(((anchors - core[i]) ** 2).sum(-1).min()) <= threshold
            if within >= coherence * len(idx):
                return idx, kmeans_anchors(core, per_domain, seed=seed)
    return None
