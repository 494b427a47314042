"""Routing index: prompt embeddings, FAISS anchors per domain, KNN vote, finding new domains' clusters."""

from adaptive.index.anchors import AnchorIndex, IndexFileError, Route, kmeans_anchors, vote
from adaptive.index.cluster import find_cluster
from adaptive.index.embedding import embed_prompt, pooled_to_numpy

__all__ = ["AnchorIndex", "IndexFileError", "Route", "embed_prompt", "find_cluster", "kmeans_anchors",
           "pooled_to_numpy", "vote"]
