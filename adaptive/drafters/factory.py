"""Every drafter is built here, from a typed description (:class:`DrafterSpec`).

:data:`DRAFTERS` is the one list of drafter kinds, the names that say what decoded a request
(the CLI's choices, results' ``decision`` and the profile's decisions all use it). How a request
is *routed* to a drafter is the runtime's vocabulary (:data:`adaptive.runtime.policies.POLICIES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.drafters.cascade import CascadeDrafter, CascadePlan
from adaptive.drafters.eagle import DEFAULT_TREE, EagleHead, TreeShape, step_settings
from adaptive.drafters.eagle_drafter import EagleDrafter
from adaptive.drafters.early_exit import EarlyExitDrafter, ExitBlock
from adaptive.drafters.head import DraftHead
from adaptive.drafters.layerskip import LayerSkipDrafter
from adaptive.drafters.live import LiveBigramTable
from adaptive.drafters.model import ModelDrafter
from adaptive.drafters.ngram import DEFAULT_BIGRAM_MIN_PROB, BigramTable, NgramDrafter
from adaptive.engine.protocol import Drafter
from adaptive.engine.skip import SkipSet
from adaptive.errors import ConfigError

DRAFTERS = {
    "ar": "no drafter: plain autoregressive decoding",
    "ssd": "self-speculative: the target with a skip set of attention/MLP sublayers left out",
    "pld": "prompt lookup: n-gram matches in the context, no forward",
    "cascade": "prompt lookup and a bigram table, under and after a layer-skip level (CS Drafting)",
    "early-exit": "the target's first layers and a trained exit block (EESD; `adaptive distill`)",
    "draft-model": "a separate small model sharing the tokenizer (`adaptive distill --drafter MODEL`)",
    "eagle": "a trained head over the target's own hidden states and a lookup token (EAGLE; `adaptive distill "
             "--drafter eagle`)",
}
LAYER_SKIP_DRAFTERS = ("ssd", "cascade")  # drafters that can draft over a reduced-vocabulary head
HEAD_DRAFTERS = (*LAYER_SKIP_DRAFTERS, "eagle")  # ... and the eagle head, whose rows are its own vocabulary


@dataclass(frozen=True, eq=False)
class DrafterSpec:
    """What to draft with. ``kind`` is one of :data:`DRAFTERS`; the other fields are the parts that
    kind needs: ``skip`` (``ssd``; a ``cascade``'s layer-skip level, optional), ``cascade`` and
    ``bigram`` (``cascade``), ``head`` (a reduced-vocabulary head for ``ssd`` or a cascade's
    layer-skip level), ``exit_layer`` and ``exit_block`` (``early-exit``), ``draft_backbone``
    (``draft-model``), ``eagle`` (``eagle``: the trained head; ``head`` then holds its rows joined with
    the prompt's tokens, :func:`eagle_vocab`; ``tree``: how its drafts branch (greedy or sampled), ``None`` for
    chains), ``label`` (a name for results)."""

    kind: str
    skip: SkipSet | None = None
    cascade: CascadePlan | None = None
    bigram: BigramTable | LiveBigramTable | None = None  # live: calibration's table learning online
    head: DraftHead | None = None
    exit_layer: int | None = None
    exit_block: ExitBlock | None = None
    draft_backbone: object = None
    eagle: EagleHead | None = None
    tree: TreeShape | None = DEFAULT_TREE
    label: str = ""

    def __post_init__(self):
        if self.kind not in DRAFTERS:
            raise ConfigError(f"unknown drafter {self.kind!r}; choose one of {', '.join(DRAFTERS)}")
        if self.kind == "ssd" and not self.skip:
            raise ConfigError("drafter 'ssd' needs a non-empty skip set (e.g. --skip-attn 4,7,9)")
        if self.head is not None and self.kind not in HEAD_DRAFTERS:
            raise ConfigError(f"a reduced draft head is for {', '.join(HEAD_DRAFTERS)} drafters, not {self.kind!r}")
        if self.kind == "eagle" and self.eagle is None:
            raise ConfigError("drafter 'eagle' needs a trained head (`adaptive distill --drafter eagle`)")
        if self.kind == "early-exit" and (self.exit_layer is None or self.exit_block is None):
            raise ConfigError("drafter 'early-exit' needs an exit layer and an exit block")
        if self.kind == "draft-model" and self.draft_backbone is None:
            raise ConfigError("drafter 'draft-model' needs the draft model's backbone")


def build_drafter(spec: DrafterSpec, backbone) -> Drafter | None:
    """The drafter ``spec`` describes, for ``backbone`` (the target); ``None`` for ``ar``.

    Drafters are cheap to build and keep no state between requests, so one is built per request;
    the exception is a draft model's drafter, whose own KV cache a caller may keep across requests
    (the runtime does: it resyncs by common prefix).
    """
    n_layers = backbone.n_layers
    if spec.kind == "ar":
        return None
    needs_layers = spec.kind in ("ssd", "early-exit") or (spec.kind == "cascade" and bool(spec.skip))
    if needs_layers and not backbone.layer_skip:
        what = "a cascade with a layer-skip level" if spec.kind == "cascade" else f"drafter {spec.kind!r}"
        raise ConfigError(f"{what} skips the target's own layers, which the {backbone.engine} engine cannot: "
                          "use --engine torch")
    if spec.kind == "pld":
        return NgramDrafter()
    if spec.kind == "ssd":
        return LayerSkipDrafter(spec.skip, n_layers, spec.head)
    if spec.kind == "cascade":
        plan = spec.cascade or CascadePlan(split=1 if spec.skip else 0, max_split=2 if spec.skip else 0)
        skip = spec.skip if spec.skip else None
        stat = NgramDrafter(bigram=spec.bigram, min_prob=plan.min_prob if spec.cascade else DEFAULT_BIGRAM_MIN_PROB)
        return CascadeDrafter(stat, skip, n_layers, split=plan.split if skip else 0, vertical=plan.vertical,
                              lenience=plan.lenience, head=spec.head if skip else None)
    if spec.kind == "eagle":
        return EagleDrafter(spec.eagle, spec.head or eagle_vocab(spec.eagle, backbone), backbone.embed_rows,
                            *step_settings(backbone), tree=spec.tree)
    if spec.kind == "early-exit":
        return EarlyExitDrafter(spec.exit_layer, n_layers, spec.exit_block, dtype=backbone.dtype,
                                device=backbone.device)
    return ModelDrafter(spec.draft_backbone, label=spec.label or "draft-model")



def eagle_vocab(head: EagleHead, backbone, prompt_ids=()) -> DraftHead:
    """The rows an eagle head drafts over: its own (the target's LM-head rows of its ids, float32), joined
    with the request's prompt tokens (the likeliest to be copied; their rows from ``backbone``)."""
    return DraftHead.build(backbone, head.ids, head.lm, extra=prompt_ids)
