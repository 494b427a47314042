"""find_cluster: a coherent group among out-of-domain requests, or none."""

import numpy as np

from adaptive.index.cluster import find_cluster


def unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def test_find_cluster_takes_a_coherent_group_and_refuses_scatter():
    rng = np.random.default_rng(0)
    centre = unit(rng.normal(size=16))
    group = unit(centre + 0.03 * rng.normal(size=(8, 16)))  # pairs ~0.03 apart (squared), below 0.05
    scatter = unit(rng.normal(size=(8, 16)))
    found = find_cluster(group, threshold=0.05, min_size=8, per_domain=4, coherence=0.75)
    assert found is not None and sorted(found[0].tolist()) == list(range(8)) and found[1].shape == (4, 16)
    assert find_cluster(scatter, threshold=0.05, min_size=8, per_domain=4, coherence=0.75) is None
    mixed = np.concatenate([scatter[:5], group])  # the group among unrelated requests
    idx, anchors = find_cluster(mixed, threshold=0.05, min_size=8, per_domain=4, coherence=0.75)
    assert sorted(idx.tolist()) == list(range(5, 13))
    assert np.allclose(np.linalg.norm(anchors, axis=1), 1.0, atol=1e-5)
