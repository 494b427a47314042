"""The prompt embedding, in one place for calibration and routing.

A prompt's embedding is the mean over its positions of the target model's final-norm hidden state
(KNN-SSD's mean-pooled last-layer representation), taken from the prefill forward itself: the
runtime gets it from the prefill it runs anyway (:func:`adaptive.engine.loop.prefill` with ``pool=True``), the
calibrator from :func:`embed_prompt`, which runs that same forward. Before any distance is
measured the :class:`~adaptive.index.anchors.AnchorIndex` scales it to unit length
(:meth:`AnchorIndex.transform`).
"""

from __future__ import annotations

import numpy as np
import torch


def pooled_to_numpy(pooled: torch.Tensor) -> np.ndarray:
    """``[hidden]`` float tensor (any device) -> ``[hidden]`` float32 numpy vector."""
    return pooled.detach().float().cpu().numpy().astype(np.float32, copy=False)


@torch.inference_mode()
def embed_prompt(backbone, prompt_ids: list[int]) -> np.ndarray:
    """``[hidden]`` float32: the pooled final hidden state of the prompt's prefill.

    Identical to the ``pooled`` vector :func:`adaptive.engine.loop.prefill` computes from the same
    ids (tested), so calibration and routing see the same vectors.
    """
    if not prompt_ids:
        raise ValueError("cannot embed an empty prompt")
    cache = backbone.new_cache(len(prompt_ids))
    out = backbone.forward(torch.tensor(prompt_ids, device=backbone.device), cache, 0, logits="none", pool=True)
    return pooled_to_numpy(out.pooled)
