"""A trained draft head over the target's own hidden states (EAGLE), with a lookup token (``eagle``).

Terms, defined once:

* *feature layers*: the depths whose residual stream the head reads, as "the residual stream after
  ``k`` decoder layers" (0: the token embeddings; ``n_layers``: the stream before the final norm).
  Every full-model forward of the target writes these rows into its cache's feature buffer
  (:attr:`adaptive.engine.backbone.KVCache.features`), by position, so a rollback costs nothing.
* *head row* ``j``: the head's input at position ``j``: the target's features at ``j`` (fused by a
  linear layer), the embedding of the token at ``j + 1`` and of the *lookup token* of ``j``; its output
  ``g_j`` stands for the target's top feature at ``j + 1`` and gives the draft for position ``j + 2``.
* *lookup token* of ``j``: the token that followed the latest earlier occurrence of the longest
  n-gram (at most :attr:`HeadShape.lookup` tokens) ending at position ``j + 1`` (prompt lookup's
  proposal, :class:`NgramIndex`), or none. A small model's text copies its context often; the head
  gets the copy as an input and a learned logit bonus on it, rather than having to learn induction
  from minutes of data (measured: held-out first-draft agreement 0.29 without it, 0.53 with it on
  the embedded model after the same 5 minutes of training; docs/history/2026-11-28-eagle-heads.md).
* *unrolled step* ``s``: at draft step ``s > 1`` a row's fused input is the head's own output of the
  row before (its stand-in for the target's feature), as in decoding, where the target has not run
  on the drafted tokens yet. Training runs ``s = 1 .. S`` (EAGLE-3's training-time test).

The head: ``u = fc([f_l1; f_l2; ...])`` (``[H]``), then one decoder layer whose attention reads
``[norm(e(x_{j+1})); norm(u); norm(e(lookup))]`` and keeps its own small KV cache, then the
target's final norm (a trainable copy) and the target's LM head over a reduced vocabulary (frozen
rows), plus ``bonus(g)`` on the lookup token's logit. The target's embedding and head stay frozen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adaptive.engine.config import FEATURE_TOPS, check_feature_layers
from adaptive.engine.quant import Linear
from adaptive.errors import ConfigError

NO_LOOKUP = -1  # a row whose n-gram occurs nowhere earlier
# Prompt lookup first: where the context's last COPY_MIN tokens (or up to 3) occurred earlier, the drafter
# proposes what followed them (free) instead of running the head (~0.02-0.06 of a step a token). On the
# held-out Spec-Bench mix: eagle 1.32x plain decoding with it, 1.26x without (one run each, within noise;
# tau 1.75 against 1.69); docs/history/2026-11-28-eagle-heads.md. 0: the head always.
COPY_MIN = 2


class NgramIndex:
    """The latest position at which each n-gram (``1 .. n``) of a token sequence ends, built as the
    sequence grows, and the lookup token it gives (prompt lookup on one token's query).

    :meth:`register` ``(tokens, upto)`` adds the n-grams ending at positions ``< upto`` not added yet;
    :meth:`lookup` ``(tokens, j)`` is the lookup token of head row ``j``: the longest n-gram ending at
    ``j + 1`` that also ends at an earlier registered position ``p``, answered with ``tokens[p + 1]``.

    Example, ``n = 2``, tokens ``[5, 7, 9, 5, 7]``: with positions ``0 .. 3`` registered, row 3 (its
    n-gram ends at position 4: ``[5, 7]``) matches ``[5, 7]`` ending at 1 -> ``tokens[2] = 9``; row 2
    (``[9, 5]`` ending at 3, then ``[5]``) matches ``[5]`` ending at 0 -> ``7``.
    """

    def __init__(self, n: int = 3):
        if n < 1:
            raise ValueError(f"an n-gram index needs n >= 1, got {n}")
        self.n = n
        self.done = 0  # positions registered
        self._last: dict[tuple[int, ...], int] = {}

    def register(self, tokens: Sequence[int], upto: int) -> None:
        for j in range(self.done, upto):
            for k in range(1, min(self.n, j + 1) + 1):
                self._last[tuple(tokens[j - k + 1: j + 1])] = j
        self.done = max(self.done, upto)

    def lookup(self, tokens: Sequence[int], j: int) -> int:
        q = j + 1
        for k in range(min(self.n, q + 1), 0, -1):
            p = self._last.get(tuple(tokens[q - k + 1: q + 1]))
            if p is not None and p < q:
                return int(tokens[p + 1])
        return NO_LOOKUP


def lookup_tokens(tokens: Sequence[int], n: int = 3) -> list[int]:
    """Every head row's lookup token (``len(tokens) - 1`` rows), as decoding sees them: row ``j`` with
    the n-grams ending at ``0 .. j`` registered. Example (``n = 2``): ``[5, 7, 9, 5, 7]`` ->
    ``[-1, -1, 7, 9]`` (rows 0 and 1: ``7`` and ``9`` occur nowhere before)."""
    index = NgramIndex(n)
    out = []
    for j in range(len(tokens) - 1):
        index.register(tokens, j + 1)
        out.append(index.lookup(tokens, j))
    return out


@dataclass(frozen=True)
class HeadShape:
    """A head's sizes (the target's: ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``intermediate``),
    its ``layers`` (feature layers, ascending), its RMSNorm ``eps``, ``rope_theta``, ``lookup`` (the longest
    n-gram of its lookup token) and ``top``: how the engine it was trained on keeps the top feature row
    (:data:`~adaptive.engine.config.FEATURE_TOPS`; it drafts only on an engine that keeps it so)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: tuple[int, ...]
    eps: float = 1e-5
    rope_theta: float = 10000.0
    lookup: int = 3
    top: str = "residual"

    def __post_init__(self):
        object.__setattr__(self, "layers", check_feature_layers(tuple(self.layers)))
        if not self.layers:
            raise ConfigError("a head reads at least one feature layer")
        if self.heads % self.kv_heads:
            raise ConfigError(f"{self.heads} heads do not group into {self.kv_heads} key-value heads")
        if self.lookup < 1:
            raise ConfigError(f"the lookup n-gram must be >= 1, got {self.lookup}")
        if self.top not in FEATURE_TOPS:
            raise ConfigError(f"a head's top feature is one of {', '.join(FEATURE_TOPS)}, got {self.top!r}")

    def to_dict(self) -> dict:
        return {**asdict(self), "layers": list(self.layers)}

    @classmethod
    def from_dict(cls, d: dict) -> HeadShape:
        return cls(**{**d, "layers": tuple(d["layers"])})


def step_settings(backbone) -> tuple[torch.dtype, str]:
    """``(dtype, weight mode)`` a head's draft step runs in beside ``backbone`` (:meth:`EagleHead.step`): its
    ``draft_dtype`` where it has one (llama.cpp, whose own weights are not torch's), else its dtype, and its
    weight mode (``dense`` where it has none)."""
    return getattr(backbone, "draft_dtype", backbone.dtype), getattr(backbone, "weight_mode", "dense")


def default_layers(n_layers: int) -> tuple[int, ...]:
    """Middle and top: ``(n // 2, n)``; for 30 layers ``(15, 30)``. Measured on the embedded model (550
    training steps, two seeds, held-out Spec-Bench answers): first draft kept 0.484 and 0.486 with
    ``(15, 30)`` against 0.475 and 0.467 with ``(3, 15, 30)`` (MT-bench 0.355/0.364 against 0.338/0.330),
    0.477 with ``(15, 22, 30)`` and 0.461 with ``(22, 27, 30)``; the 8-minute product run, 0.481 against
    0.479 and 0.482, level within its spread. A low layer adds nothing the head learns to use in minutes,
    and two rows a position cost less (docs/history/2026-11-28-eagle-heads.md, tenth session)."""
    return tuple(sorted({max(1, n_layers // 2), n_layers}))


@dataclass(frozen=True)
class TreeShape:
    """How an eagle drafter branches (EAGLE-2's dynamic tree): each depth expands the ``width``
    likeliest nodes by the head's path probability, each by its ``width`` likeliest next tokens, and the
    ``nodes`` likeliest of all the candidates (a tree: a node is never likelier than its parent) go to
    one verification. The depth is the step's draft length (the bandit's choice). Example: width 3,
    nodes 6, depth 2: three first tokens, nine second ones below them, the six likeliest of the twelve."""

    width: int = 3
    nodes: int = 8
    min_prob: float = 0.0  # a node off the main chain whose path the head gives less than this is left out

    def __post_init__(self):
        if self.width < 1 or self.nodes < 1:
            raise ConfigError(f"a draft tree needs width >= 1 and nodes >= 1, got {self.width} and {self.nodes}")
        if not 0.0 <= self.min_prob < 1.0:
            raise ConfigError(f"a draft tree's min_prob must be in [0, 1), got {self.min_prob}")


# The tree an eagle drafter branches by default. On the 2-core AMD EPYC host (SmolLM2-135M, torch bf16, 24
# held-out Spec-Bench prompts, the `eagle` policy, each arm its own bandit, one interleaved run): tau 1.89 as
# chains, 2.28 as 4x10 trees, 2.13 with the 0.05 floor; decoding 54.3, 56.1 and 58.1 tok/s. Every node costs
# a verification row (11 rows: 32.6 ms a step against 28.8 for chains' 2.8 nodes), so nodes the head gives
# less than 0.05 are left out (4.2 nodes a step, 29.2 ms). A second run (benchmarks/eagle_trees.py): 60.4, 60.8
# and 62.3 tok/s. docs/history/2026-11-28-eagle-heads.md.
DEFAULT_TREE = TreeShape(4, 10, 0.05)


class HeadCache:
    """The head's own keys and values (``[kv_heads, capacity, head_dim]``, float32) and ``length``: the
    rows computed from the target's own features; rows beyond it are drafts' (overwritten next time).
    ``slot``: the tensors of a pooled slot to use (the head's captured steps replay over them)."""

    def __init__(self, shape: HeadShape, capacity: int, device, slot: tuple[torch.Tensor, ...] | None = None):
        if slot is None:
            self.k = torch.zeros(shape.kv_heads, capacity, shape.head_dim, device=device)
            self.v = torch.zeros_like(self.k)
        else:
            self.k, self.v = slot[0], slot[1]
        # a pooled slot's tensors (k, v and the request's extra rows: adaptive.drafters.eagle_static), whose
        # captured steps write them while ``k`` is still ``slot[0]`` (room() grows a copy)
        self.slot = slot
        self.length = 0

    def room(self, rows: int) -> None:
        """Grow (doubling) to hold ``rows`` rows."""
        cap = self.k.shape[1]
        if rows > cap:
            new = max(rows, 2 * cap)
            self.k = torch.cat([self.k, self.k.new_zeros(self.k.shape[0], new - cap, self.k.shape[2])], 1)
            self.v = torch.cat([self.v, self.v.new_zeros(self.v.shape[0], new - cap, self.v.shape[2])], 1)


class EagleHead(nn.Module):
    """The network (float32). ``lm`` (``[V', H]``) holds the target's LM-head rows of ``ids`` (``[V']``),
    frozen; ``embed`` is not held: the caller passes token embeddings (the target's, frozen)."""

    def __init__(self, shape: HeadShape, ids: torch.Tensor, lm_rows: torch.Tensor, final_norm: torch.Tensor):
        super().__init__()
        s = self.shape = shape
        H, nf = s.hidden, len(s.layers)
        self.fc = nn.Linear(nf * H, H, bias=False)
        self.norm_token = nn.Parameter(torch.ones(H))
        self.norm_feature = nn.Parameter(torch.ones(H))
        self.norm_lookup = nn.Parameter(torch.ones(H))
        self.no_lookup = nn.Parameter(torch.zeros(H))  # the lookup input of a row without one
        self.qkv = nn.Linear(3 * H, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        self.o = nn.Linear(s.heads * s.head_dim, H, bias=False)
        self.norm_mlp = nn.Parameter(torch.ones(H))
        self.gate = nn.Linear(H, s.intermediate, bias=False)
        self.up = nn.Linear(H, s.intermediate, bias=False)
        self.down = nn.Linear(s.intermediate, H, bias=False)
        self.norm_out = nn.Parameter(final_norm.detach().float().clone())
        self.bonus = nn.Linear(H, 1)
        self.register_buffer("ids", ids.detach().long().clone())
        self.register_buffer("lm", lm_rows.detach().float().clone())
        with torch.no_grad():  # start as the top feature passed through, the layer adding nothing
            self.fc.weight.zero_()
            self.fc.weight[:, (nf - 1) * H:] = torch.eye(H)
            self.o.weight.zero_()
            self.down.weight.zero_()
            self.bonus.weight.zero_()
            self.bonus.bias.fill_(2.0)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- pieces shared by training and drafting ---------------------------------------------------

    def rope(self, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, ``[end - start, head_dim]``, for positions ``start .. end-1`` (a grown table)."""
        if self._rope is None or self._rope[0].shape[0] < end or self._rope[0].device != torch.device(device):
            n = max(end, 2 * (0 if self._rope is None else self._rope[0].shape[0]), 256)
            d = self.shape.head_dim
            inv = 1.0 / (self.shape.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
            ang = torch.outer(torch.arange(n, device=device).float(), inv)
            ang = torch.cat([ang, ang], -1)
            self._rope = (ang.cos(), ang.sin())
        return self._rope[0][start:end], self._rope[1][start:end]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm with ``weight`` in ``x``'s dtype (bf16 under autocast: the fused kernel)."""
        return F.rms_norm(x, (self.shape.hidden,), weight.to(x.dtype), self.shape.eps)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., n_layers_read, H]`` target features -> ``[..., H]``."""
        return self.fc(features.flatten(-2))

    def lookup_input(self, lookup_emb: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
        return torch.where(has.unsqueeze(-1), lookup_emb, self.no_lookup.to(lookup_emb.dtype))

    def project(self, u, e, lk, cos, sin):
        """``[..., T, H]`` inputs -> q ``[..., heads, T, D]``, k and v ``[..., kv_heads, T, D]``."""
        s = self.shape
        x = torch.cat([self._norm(e, self.norm_token), self._norm(u, self.norm_feature),
                       self._norm(lk, self.norm_lookup)], -1)
        qkv = self.qkv(x)
        T = x.shape[-2]
        lead = x.shape[:-2]
        q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
        q = q.reshape(*lead, T, s.heads, s.head_dim).transpose(-2, -3)
        k = k.reshape(*lead, T, s.kv_heads, s.head_dim).transpose(-2, -3)
        v = v.reshape(*lead, T, s.kv_heads, s.head_dim).transpose(-2, -3)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def finish(self, u: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual ``u`` plus the attention's output (``[..., T, heads * D]``), then the MLP: ``g``."""
        g = u + self.o(attended)
        n = self._norm(g, self.norm_mlp)
        return g + self.down(F.silu(self.gate(n)) * self.up(n))

    def logits(self, g: torch.Tensor, lookup_index: torch.Tensor, lm: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., V']`` float32 logits over the head's rows (``lm``: other rows, e.g. with a request's
        prompt tokens added), plus the bonus at ``lookup_index`` (``[...]``; ``-1``: none)."""
        n = self._norm(g, self.norm_out)
        out = F.linear(n, self.lm if lm is None else lm).float()
        has = lookup_index >= 0
        bonus = (self.bonus(n).squeeze(-1).float() * has).unsqueeze(-1)
        return out.scatter_add(-1, lookup_index.clamp(min=0).unsqueeze(-1), bonus)

    def _attend_grouped(self, q, k, v):
        rep = self.shape.heads // self.shape.kv_heads
        return k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)

    # -- training: S unrolled steps over whole windows --------------------------------------------

    def unrolled(self, features: torch.Tensor, tokens_emb: torch.Tensor, lookup_emb: torch.Tensor,
                 has_lookup: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Outputs ``g`` (``[B, T, H]`` each) of steps ``1 .. steps`` for windows of ``T`` rows.

        ``features`` ``[B, T, n_read, H]``: row ``j``'s target features; ``tokens_emb`` ``[B, T, H]``: the
        embedding of the token after ``j``; ``lookup_emb`` and ``has_lookup``: its lookup token's;
        ``valid`` ``[B, T]``: rows that exist (padding after them). Step ``s`` row ``j`` sees what
        draft ``s`` sees in decoding: the rows ``0 .. j-s+1`` computed from the target's features,
        then its own chain of draft rows ``j-s+2 .. j`` (one per earlier step).
        """
        B, T = tokens_emb.shape[:2]
        cos, sin = self.rope(0, T, tokens_emb.device)
        lk = self.lookup_input(lookup_emb, has_lookup)
        u = self.fuse(features)
        keys, vals, outs = [], [], []
        rows = torch.arange(T, device=tokens_emb.device)
        scale = 1.0 / math.sqrt(self.shape.head_dim)
        for s in range(1, steps + 1):
            if s > 1:  # a row's input is the head's own output of the row before
                u = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)
            q, k, v = self.project(u, tokens_emb, lk, cos, sin)
            k, v = self._attend_grouped(q, k, v)
            keys.append(k)
            vals.append(v)
            scores = (q * scale) @ keys[0].transpose(-1, -2)  # [B, heads, T, T] over the target-feature rows
            allowed = (rows[None, :] <= rows[:, None] - (s - 1)) & valid[:, None, None, :]
            scores = scores.masked_fill(~allowed, float("-inf"))
            chain = [((q * scale) * torch.roll(keys[t], s - 1 - t, -2)).sum(-1, keepdim=True) for t in range(1, s)]
            weights = torch.softmax(torch.cat([scores, *chain], -1), -1).nan_to_num(0.0)
            out = weights[..., :T] @ vals[0]
            for t in range(1, s):
                out = out + weights[..., T + t - 1: T + t] * torch.roll(vals[t], s - 1 - t, -2)
            outs.append(self.finish(u, out.transpose(1, 2).reshape(B, T, -1)))
        return outs

    # -- drafting ---------------------------------------------------------------------------------

    def step(self, dtype: torch.dtype, mode: str = "dense") -> EagleStep:
        """The head as a draft step runs it (:class:`EagleStep`): its weights in ``dtype`` and the
        target's weight ``mode`` (``packed``: oneDNN's layout; anything else: dense), built on first use
        from the weights as they are then and kept."""
        key = (dtype, "packed" if mode == "packed" else "dense")
        steps = self.__dict__.setdefault("_steps", {})
        if key not in steps:
            steps[key] = EagleStep(self, *key)
        return steps[key]

    def built_steps(self) -> list[EagleStep]:
        """The draft steps :meth:`step` has built so far."""
        return list(self.__dict__.get("_steps", {}).values())

    # -- storage ------------------------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        """The weights to store: the LM-head rows ``lm`` in bf16 where bf16 holds them exactly (a bf16 target's
        own rows, in half the bytes; :meth:`from_state` reads them back as float32), everything else as it is."""
        out = {k: v.detach().clone() for k, v in self.state_dict().items()}
        half = out["lm"].to(torch.bfloat16)
        if torch.equal(half.float(), out["lm"]):
            out["lm"] = half
        return out

    @classmethod
    def from_state(cls, shape: HeadShape, tensors: dict[str, torch.Tensor]) -> EagleHead:
        """Rebuild a head from its :class:`HeadShape` and :meth:`state` (``ValueError`` when they disagree)."""
        try:
            head = cls(shape, tensors["ids"], tensors["lm"], tensors["norm_out"])
            head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()},
                                 strict=True)
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"head weights do not fit {shape}: {exc}") from None
        return head.requires_grad_(False).eval()


class EagleStep:
    """An :class:`EagleHead`'s draft step with its weights as the target's step has its own: in the
    target's dtype and, on a CPU with packed weights, in oneDNN's layout (:class:`~adaptive.engine.quant.Linear`).

    A draft token reads every weight of the head once, a one-row product memory-bound on the CPU: in
    float32 the head's ~10M weights (its rows of the LM head half of them) are ~41 MB a token, 0.2 of a
    packed bf16 step of the embedded model (measured); in bf16 half that, packed faster again. The
    attention (its own small cache) stays in float32. Same formulas as :meth:`EagleHead.unrolled` and
    :meth:`EagleHead.logits` (a test holds a float32 step equal to them at every unrolled step)."""

    def __init__(self, head: EagleHead, dtype: torch.dtype, mode: str):
        self.shape, self.dtype = head.shape, dtype

        def lin(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            w = weight.detach().to(dtype).contiguous()
            return Linear.build(w, None if bias is None else bias.detach().to(dtype), mode)

        with torch.no_grad():
            self.fc, self.qkv, self.o = lin(head.fc.weight), lin(head.qkv.weight), lin(head.o.weight)
            self.gate_up = lin(torch.cat([head.gate.weight, head.up.weight]))
            self.down = lin(head.down.weight)
            self.lm = lin(head.lm)
            self.bonus_w = head.bonus.weight.detach().to(dtype).reshape(-1)
            self.bonus_b = float(head.bonus.bias)
            self.norms = {n: getattr(head, n).detach().to(dtype) for n in
                          ("norm_token", "norm_feature", "norm_lookup", "norm_mlp", "norm_out")}
            self.no_lookup = head.no_lookup.detach().to(dtype)
        self.ids = head.ids
        self.rope = head.rope
        self.capturable = True  # its levels may be captured as CUDA graphs (False once its head was replaced)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x, (self.shape.hidden,), self.norms[name], self.shape.eps)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[T, n_layers_read, H]`` target features -> ``[T, H]`` in the step's dtype."""
        return self.fc(features.flatten(-2).to(self.dtype))

    def project(self, u: torch.Tensor, tokens_emb: torch.Tensor, lookup_emb: torch.Tensor, has_lookup: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A block of ``T`` rows' query ``[heads, T, D]``, key and value ``[kv_heads, T, D]`` (float32, the query
        and key rotated by ``cos``/``sin``, ``[T, D]``) from its inputs (``[T, H]``; ``has_lookup`` ``[T]``)."""
        s, dt = self.shape, self.dtype
        T = u.shape[0]
        lk = torch.where(has_lookup.unsqueeze(-1), lookup_emb.to(dt), self.no_lookup)
        x = torch.cat([self._norm(tokens_emb.to(dt), "norm_token"), self._norm(u, "norm_feature"),
                       self._norm(lk, "norm_lookup")], -1)
        qkv = self.qkv(x).float().view(T, s.heads + 2 * s.kv_heads, s.head_dim).transpose(0, 1)
        return (EagleHead._rotate(qkv[:s.heads], cos, sin),
                EagleHead._rotate(qkv[s.heads:s.heads + s.kv_heads], cos, sin), qkv[s.heads + s.kv_heads:])

    def attend(self, u: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               banned: torch.Tensor | None) -> torch.Tensor:
        """The rows' output ``g`` (``[T, H]``, the step's dtype): their inputs ``u`` plus the attention of ``q``
        (:meth:`project`'s) over ``keys``/``values`` (``[kv_heads, C, D]``; ``banned`` ``[T, C]``, True: may not
        look; ``None``: all), then the MLP."""
        s = self.shape
        T = q.shape[1]
        G = s.heads // s.kv_heads  # grouped heads as a batch: no key or value copied per head
        q = q.reshape(s.kv_heads, G * T, s.head_dim) / math.sqrt(s.head_dim)
        scores = q @ keys.transpose(-1, -2)  # [KV, G*T, C]
        if banned is not None:
            scores = scores.view(s.kv_heads, G, T, -1).masked_fill(banned, float("-inf")).view_as(scores)
        out = (torch.softmax(scores, -1) @ values).view(s.heads, T, s.head_dim)
        g = u + self.o(out.transpose(0, 1).reshape(T, -1).to(self.dtype))
        gate, up = self.gate_up(self._norm(g, "norm_mlp")).chunk(2, -1)
        return g + self.down(F.silu(gate) * up)

    def rows(self, u: torch.Tensor, tokens_emb: torch.Tensor, lookup_emb: torch.Tensor, has_lookup: torch.Tensor,
             cache: HeadCache, start: int, positions: torch.Tensor | None = None,
             banned: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start .. start+T-1`` (inputs ``[T, H]``) attending to the cache's rows ``0 .. start-1`` and to
        each other causally, their keys written at those rows: ``g``, ``[T, H]`` in the step's dtype.
        A tree's rows (:meth:`EagleDrafter.propose`) give their own ``positions`` (``[T]``, for the rotary
        embedding; default: the rows') and ``banned`` (``[T, start + T]``, True: may not look; default causal)."""
        T = u.shape[0]
        if positions is None:
            cos, sin = self.rope(start, start + T, u.device)
        else:
            cos, sin = self.rope(0, int(positions.max()) + 1, u.device)
            cos, sin = cos[positions], sin[positions]
        q, k, v = self.project(u, tokens_emb, lookup_emb, has_lookup, cos, sin)
        cache.room(start + T)
        cache.k[:, start:start + T] = k
        cache.v[:, start:start + T] = v
        if banned is None and T > 1:
            banned = torch.ones(T, start + T, dtype=torch.bool, device=u.device).triu_(start + 1)
        return self.attend(u, q, cache.k[:, :start + T], cache.v[:, :start + T], banned)

    def logits(self, g: torch.Tensor, lookup_index: torch.Tensor, extra: torch.Tensor | None = None,
               extra_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, V' + E]`` float32 logits over the head's rows, then ``extra``'s (``[E, H]``, a request's
        prompt tokens' rows), plus the bonus at ``lookup_index`` (``[T]``; -1: none). ``extra_rows`` (a
        0-d long tensor): only that many of ``extra``'s rows are the request's (a static step's padded
        buffer); the others' logits are ``-inf``."""
        n = self._norm(g, "norm_out")
        out = self.lm(n)
        if extra is not None and extra.shape[0]:
            more = F.linear(n, extra.to(self.dtype))
            if extra_rows is not None:
                more = more.masked_fill(torch.arange(extra.shape[0], device=more.device) >= extra_rows, float("-inf"))
            out = torch.cat([out, more], -1)
        out = out.float()
        has = lookup_index >= 0
        bonus = ((n @ self.bonus_w).float() + self.bonus_b) * has
        return out.scatter_add(-1, lookup_index.clamp(min=0).unsqueeze(-1), bonus.unsqueeze(-1))
