"""The prompt embedding, in one place for calibration and routing.

A prompt's embedding is a hidden state of the target model's prefill, as a
:class:`~adaptive.engine.config.Pooling` says: KNN-SSD's mean over the positions of the last layer
(``Pooling()``), or, calibration's default since issue 17, the residual stream at the last
position after a third of the layers (through the final norm), which routed held-out Spec-Bench
prompts 160/160 where the final mean routed 154/160
(docs/history/2026-11-23-calibration-in-minutes.md). It is taken from the prefill forward
itself: the runtime gets it from the prefill it runs anyway (:func:`adaptive.engine.loop.prefill`
with ``pool=``), the calibrator and ``adaptive route`` from
:func:`embed_prompt`, which runs that same forward. The index records the pooling it was built
with (:attr:`AnchorIndex.pooling`). Before any distance is measured the
:class:`~adaptive.index.anchors.AnchorIndex` scales it to unit length (:meth:`AnchorIndex.transform`).
"""

from __future__ import annotations

import numpy as np
import torch

from adaptive.engine.config import Pooling


def pooled_to_numpy(pooled: torch.Tensor) -> np.ndarray:
    """``[hidden]`` float tensor (any device) -> ``[hidden]`` float32 numpy vector."""
    return pooled.detach().float().cpu().numpy().astype(np.float32, copy=False)


@torch.inference_mode()
def embed_prompt(backbone, prompt_ids: list[int], pooling: Pooling | None = None) -> np.ndarray:
    """``[hidden]`` float32: the prompt's embedding from its prefill, as ``pooling`` says (default:
    ``Pooling()``, the final hidden state's mean).

    Identical to the ``pooled`` vector :func:`adaptive.engine.loop.prefill` computes from the same
    ids and pooling (tested), so calibration and routing see the same vectors.
    """
    if not prompt_ids:
        raise ValueError("cannot embed an empty prompt")
    pooling = pooling or Pooling()
    cache = backbone.new_cache(len(prompt_ids))
    out = backbone.forward(torch.tensor(prompt_ids, device=backbone.device), cache, 0, logits="none",
                           **backbone.pool_args(pooling))
    return pooled_to_numpy(backbone.pooled(out, pooling))
