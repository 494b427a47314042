"""What distillation trains: an early-exit block, or a whole separate draft model.

Both expose the same small interface to the trainer: ``parameters()``; ``masks`` (the skip masks
whose teacher-forced hidden states the student trains on, stored per position; ``None``: nothing
stored); ``draw(ds, generator, batch)`` (the rows of one
training batch); ``logq(ds, rows)`` (``[len(rows), V]`` log-probabilities, differentiable);
``sample(prompt, n, generator)`` (on-policy data: the student's own continuation); and
``state()``/``load_state()``.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptive.distill.data import TrainSequence, capture_hidden, continue_ids
from adaptive.drafters.early_exit import ExitBlock, early_exit_skip


@dataclass
class Dataset:
    """Training or evaluation rows: one per trained position of ``seqs``, in order.

    ``h_target``: ``[R, H]`` the target's pre-norm residual stream (p is computed from it per batch);
    ``offsets``: ``[S+1]`` row ranges per sequence; ``features``: the student's own per-row data.
    """

    seqs: list[TrainSequence]
    h_target: torch.Tensor
    offsets: list[int]
    features: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    @classmethod
    def build(cls, backbone, seqs: list[TrainSequence], student) -> Dataset:
        pairs = [capture_hidden(backbone, s, student.masks) for s in seqs]
        offsets = [0]
        for h, _ in pairs:
            offsets.append(offsets[-1] + h.shape[0])
        features = torch.cat([d for _, d in pairs]) if student.masks is not None else None
        return cls(list(seqs), torch.cat([h for h, _ in pairs]), offsets, features)


class TargetHead:
    """The target's final norm and LM head in float32: ``logp(h [N, H]) -> [N, V]`` (no gradient)."""

    def __init__(self, backbone):
        self.weight = backbone.head_weight().detach().float()
        self.bias = None if backbone.lm_head.bias is None else backbone.lm_head.bias.detach().float()
        self.norm = backbone.norm.weight.detach().float()
        self.eps = backbone.norm_eps

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(h, (h.shape[-1],), self.norm, self.eps), self.weight, self.bias)

    def logp(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.logits(h), -1)


class ExitStudent:
    """The early-exit drafter's block, trained on stored hidden states (the backbone stays frozen)."""

    kind = "early-exit"

    def __init__(self, lm, exit_layer: int):
        self.bb = lm.backbone
        self.exit_layer = exit_layer
        self.masks = early_exit_skip(exit_layer, lm.n_layers).masks(lm.n_layers)
        self.block = ExitBlock.from_backbone(self.bb, exit_layer)  # float32, identity at start
        self.head = TargetHead(self.bb)

    def parameters(self):
        return self.block.parameters()

    def draw(self, ds: Dataset, generator: torch.Generator, batch: int) -> torch.Tensor:
        return torch.randint(0, ds.rows, (batch,), generator=generator)

    def logq(self, ds: Dataset, rows: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head.logits(self.block(ds.features[rows])), -1)

    def inference_block(self) -> ExitBlock:
        """A copy of the block in the model's dtype, as the drafter runs it."""
        return copy.deepcopy(self.block).to(self.bb.dtype).eval()

    def sample(self, prompt: list[int], n: int, generator, temperature: float, eos) -> list[int]:
        return continue_ids(self.bb, prompt, n, temperature=temperature, generator=generator,
                            skip_masks=self.masks, adapter=self.inference_block(), eos=eos)

    def state(self) -> dict:
        return {k: v.detach().clone() for k, v in self.block.state_dict().items()}

    def load_state(self, state: dict) -> None:
        self.block.load_state_dict(state)

    def meta(self) -> dict:
        return {"exit_layer": self.exit_layer, "block": self.block.meta()}


class ModelStudent:
    """A separate draft model, fine-tuned whole (float32); ``draw`` picks whole sequences."""

    kind = "draft-model"
    masks = None  # it runs its own model on the token ids: no hidden states stored

    def __init__(self, draft_lm):
        self.lm = draft_lm
        self.model = draft_lm.model
        self.model.train(False)  # no dropout: the distribution trained is the one drafted with

    def parameters(self):
        return self.model.parameters()

    def draw(self, ds: Dataset, generator: torch.Generator, batch: int) -> torch.Tensor:
        picks = torch.randint(0, len(ds.seqs), (min(batch, len(ds.seqs)),), generator=generator).tolist()
        return torch.cat([torch.arange(ds.offsets[i], ds.offsets[i + 1]) for i in picks])

    def logq(self, ds: Dataset, rows: torch.Tensor) -> torch.Tensor:
        """Rows must cover whole sequences (as ``draw`` and evaluation give them)."""
        out, r, rows = [], 0, rows.tolist()
        while r < len(rows):
            i = bisect.bisect_right(ds.offsets, rows[r]) - 1
            s = ds.seqs[i]
            ids = torch.tensor([s.ids], device=self.lm.device)
            logits = self.model(input_ids=ids).logits[0, s.start - 1: len(s.ids) - 1].float()
            out.append(torch.log_softmax(logits, -1))
            r += s.n_positions
        return torch.cat(out)

    def sample(self, prompt: list[int], n: int, generator, temperature: float, eos) -> list[int]:
        return continue_ids(self.lm.backbone, prompt, n, temperature=temperature, generator=generator, eos=eos)

    def state(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def meta(self) -> dict:
        return {"model_config": self.model.config.to_dict(), "source": self.lm.source, "name": self.lm.name}
