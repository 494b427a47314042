"""Anchors, the KNN vote and the index files."""

import numpy as np
import pytest

from adaptive.index.anchors import AnchorIndex, IndexFileError, kmeans_anchors, vote


def test_vote_worked_example():
    # math at 0.1 scores 10; two code neighbours at 0.3 score 3.33 each: math wins with 0.6.
    winner, scores = vote(["math", "code", "code"], [0.1, 0.3, 0.3], eps=0.0)
    assert winner == "math"
    assert scores["math"] == pytest.approx(0.6)
    assert scores["code"] == pytest.approx(0.4)


def test_vote_many_far_neighbours_beat_one_near():
    # code 3 x 1/0.2 = 15 beats math 1/0.1 = 10.
    assert vote(["math", "code", "code", "code"], [0.1, 0.2, 0.2, 0.2], eps=0.0)[0] == "code"


def test_vote_tie_goes_to_the_nearer_label():
    assert vote(["a", "b"], [0.5, 0.5])[0] == "a"
    assert vote(["b", "a"], [0.5, 0.5])[0] == "b"


def test_vote_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        vote(["a"], [0.1, 0.2])
    with pytest.raises(ValueError):
        vote([], [])


def test_kmeans_anchors_are_unit_and_capped():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    a = kmeans_anchors(x, 4, seed=0)
    assert a.shape == (4, 8)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    b = kmeans_anchors(x, 50)  # capped by the number of points: every point is an anchor
    np.testing.assert_allclose(b, x, atol=1e-6)


def _clusters(seed=0, n=10, dim=16):
    rng = np.random.default_rng(seed)
    centres = {"code": np.eye(dim)[0] * 5, "math": np.eye(dim)[1] * 5, "qa": np.eye(dim)[2] * 5}
    return {d: (c + rng.normal(scale=0.5, size=(n, dim))).astype(np.float32) for d, c in centres.items()}, centres


def test_build_and_route_synthetic_clusters():
    emb, centres = _clusters()
    idx = AnchorIndex.build(emb, per_domain=3, k=3)
    assert sorted(idx.domains) == ["code", "math", "qa"]
    assert len(idx.labels) == 9
    rng = np.random.default_rng(1)
    for dom, c in centres.items():
        for _ in range(5):
            r = idx.route(c + rng.normal(scale=0.5, size=c.shape))
            assert r.domain == dom and not r.out_of_domain
            assert len(r.neighbours) == 3 and r.neighbours[0][1] <= r.neighbours[-1][1]
    # a direction no domain points to is out of domain: the global set applies
    far = np.eye(16)[7] * 5
    r = idx.route(far)
    assert r.out_of_domain and r.domain is None and r.nearest_domain in centres


def test_each_domain_has_its_own_radius():
    """A tight domain and a spread one: each radius is the margin over its own leave-one-out
    distances, so a request just beyond the tight domain is out-of-domain although it lies well
    within the spread domain's radius (a single threshold, the largest, would let it in)."""
    rng = np.random.default_rng(0)
    tight_c, spread_c = np.eye(16)[0], np.eye(16)[1]
    emb = {"tight": tight_c + 0.01 * rng.normal(size=(12, 16)), "spread": spread_c + 0.3 * rng.normal(size=(12, 16))}
    idx = AnchorIndex.build(emb, per_domain=4, k=3)
    r_tight, r_spread = idx.threshold("tight"), idx.threshold("spread")
    assert r_tight < r_spread == idx.ood_threshold and set(idx.ood_thresholds) == {"tight", "spread"}
    assert idx.threshold("unknown") == idx.ood_threshold
    near = tight_c + 0.01 * rng.normal(size=16)
    assert idx.route(near).domain == "tight"
    # a point whose nearest anchor is a tight one, beyond the tight radius but within the spread one
    x = idx.transform(tight_c)[0]
    off = np.eye(16)[5]
    for t in np.linspace(0.0, 1.0, 200):
        v = x + t * off
        d = float(idx.search(v, 1)[0][0, 0])
        if r_tight < d < r_spread:
            break
    else:
        pytest.fail("no point between the two radii")
    r = idx.route(v)
    assert r.nearest_domain == "tight" and r.out_of_domain and r.domain is None
    with pytest.raises(ValueError, match="without anchors"):
        AnchorIndex(idx.anchors, idx.labels, idx.mean, 1.0, ood_thresholds={"nope": 1.0})


def test_index_round_trip(tmp_path):
    import json

    from adaptive.engine.config import Pooling

    emb, centres = _clusters()
    idx = AnchorIndex.build(emb, per_domain=4, k=2, center=True, pooling=Pooling(10, "last"))
    idx.save(tmp_path)
    back = AnchorIndex.load(tmp_path)
    assert back.labels == idx.labels and back.k == 2 and back.ood_threshold == idx.ood_threshold
    assert back.ood_thresholds == idx.ood_thresholds and len(back.ood_thresholds) == 3
    assert back.pooling == Pooling(10, "last")  # routing embeds prompts as calibration did
    meta = json.loads((tmp_path / "anchors.json").read_text())
    del meta["pooling"]  # an index written before issue 17: the final mean
    del meta["ood_thresholds"]  # before issue 20: one threshold for every domain
    (tmp_path / "anchors.json").write_text(json.dumps(meta))
    old = AnchorIndex.load(tmp_path)
    assert old.pooling == Pooling() and old.ood_thresholds == {} and old.threshold("math") == idx.ood_threshold
    np.testing.assert_array_equal(back.mean, idx.mean)
    v = centres["math"] + 0.1
    assert back.route(v).to_dict() == idx.route(v).to_dict()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing", "labels", "dimension"])
def test_damaged_index_files_are_clear_errors(tmp_path, damage):
    emb, _ = _clusters()
    AnchorIndex.build(emb, per_domain=2).save(tmp_path)
    f = tmp_path / "anchors.faiss"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:40])
    elif damage == "garbage":
        f.write_bytes(b"not an index at all" * 10)
    elif damage == "missing":
        f.unlink()
    elif damage == "labels":
        (tmp_path / "anchors.json").write_text('{"labels": ["a"], "ood_threshold": 1, "k": 1}')
    else:
        np.save(tmp_path / "embedding_mean.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(IndexFileError, match="anchors|embedding_mean"):
        AnchorIndex.load(tmp_path)


def test_wrong_embedding_dimension_is_an_error():
    emb, _ = _clusters()
    idx = AnchorIndex.build(emb, per_domain=2)
    with pytest.raises(IndexFileError, match="dimension"):
        idx.route(np.zeros(5, dtype=np.float32))
