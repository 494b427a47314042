"""Training an eagle head (``adaptive distill --drafter eagle``): the target's own text and features.

One run:

1. encodes each domain's prompts and holds out the last ``held_out`` fraction of every domain;
2. decodes the target's greedy continuations of every prompt, several sequences per forward
   (:meth:`~adaptive.engine.backbone.Backbone.forward_batch`), each sequence's cache keeping the
   head's feature rows, so the features of prompt and continuation come from the decoding itself:
   no second pass (checkpointed: the longest part); with ``samples`` > 1, more continuations of the
   training prompts sampled at ``temperature`` (each set checkpointed);
3. picks the head's rows: the ``vocab`` most frequent tokens of the training text, then by id
   (:func:`~adaptive.drafters.head.rank_tokens`), and reports their coverage of the held-out answers;
4. trains the head with AdamW on forward KL to the target's distribution (soft targets) renormalised
   over a drafter's rows, those and the prompt's tokens (:meth:`HeadTrainer.rows_for`), at every
   position of the training text, over ``unroll`` unrolled steps
   (:meth:`~adaptive.drafters.eagle.EagleHead.unrolled`); the number of steps is ``steps``, or as many
   as fit in ``minutes``: set from the first steps' pace and the evaluations', then re-paced after
   every evaluation over the steps since the last one (steps slow down as a run goes on), and
   checkpointed with the run;
5. evaluates on the held-out answers over each one's drafter's rows: per draft position, the share
   of positions whose first ``s`` drafts all equal the target's greedy tokens (greedy verification's
   acceptance), by domain;
6. checkpoints every ``checkpoint_every`` steps; measures the head's draft cost; stores the head.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from adaptive.drafters.eagle import EagleHead, HeadCache, HeadShape, default_layers, lookup_tokens, step_settings
from adaptive.drafters.factory import eagle_vocab
from adaptive.drafters.head import rank_tokens
from adaptive.engine.backbone import Segment
from adaptive.engine.sampling import warp_probs
from adaptive.errors import ConfigError
from adaptive.measure.interval import bootstrap_share

STEP_WEIGHTS = (1.0, 0.8, 0.6, 0.5)  # the loss weight of unrolled step s (later steps matter less: fewer reach them)
SAMPLE_TEMPERATURE = 0.7  # sampled continuations' temperature (``samples`` > 1)


def check_training(cfg, counts: tuple[str, ...]) -> None:
    """The checks every distillation config shares (:class:`HeadConfig`, ``DistillConfig``): each field of
    ``counts`` a positive integer, ``lr`` a finite positive number, ``held_out`` in (0, 1); else a
    :class:`ConfigError` naming the option."""
    for name in counts:
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive number, got {cfg.lr}")
    if not 0.0 < cfg.held_out < 1.0:
        raise ConfigError(f"held_out must be in (0, 1), got {cfg.held_out}")


PACE_STEPS = 10  # steps timed before a minutes budget sets the schedule's length (then re-paced: repace_every)


class Pacer:
    """The length of a schedule under a ``minutes`` budget, as it goes: :meth:`length` after each step.

    The first :data:`PACE_STEPS` steps' pace sets it; then it is re-paced at each evaluation and every
    :func:`repace_every` steps between them (so a length set by slow first steps grows where no
    evaluation comes), over the steps since the last re-pacing at their own pace, plus the evaluations
    to come at the last one's cost (:meth:`evaluated`). ``spent``: the seconds the budget had spent
    when this process took the run up (a resumed one's), ``start``: then, on ``time.perf_counter``."""

    def __init__(self, minutes: float, eval_every: int, eval_seconds: float, start: float, spent: float, step: int):
        self.minutes, self.eval_every, self.eval_seconds = minutes, eval_every, eval_seconds
        self.start, self.spent = start, spent
        self.window = (start, step, 0.0)  # since the last re-pacing: its time, its step, its evaluations' seconds
        self.pace = 0.0  # the last pacing's seconds a step (its steps' own, without evaluations)

    def evaluated(self, seconds: float) -> None:
        """An evaluation took ``seconds``."""
        self.eval_seconds = seconds
        self.window = (*self.window[:2], self.window[2] + seconds)

    def length(self, step: int, total: int | None, now: float, evaluated: bool) -> int | None:
        """The schedule's length after ``step`` (``total``: the length so far, ``None`` before the pace)."""
        t0, s0, evals = self.window
        due = step >= PACE_STEPS if total is None else (evaluated or step - s0 >= repace_every(total))
        if not due or step <= s0:
            return total
        self.pace = (now - t0 - evals) / (step - s0)
        self.window = (now, step, 0.0)
        return budget_steps(self.minutes, step, self.spent + now - self.start,
                            self.pace + self.eval_seconds / self.eval_every)


def repace_every(total: int) -> int:
    """Steps between two re-pacings of a schedule of ``total`` steps where no evaluation comes first (each
    evaluation re-paces too): a quarter of it, at least :data:`PACE_STEPS`. Example: 90 -> 22; 30 -> 10."""
    return max(PACE_STEPS, total // 4)


def budget_steps(minutes: float, step: int, spent_s: float, pace_s: float) -> int:
    """The schedule's length under a ``minutes`` budget: the ``step`` steps taken in ``spent_s``
    seconds, and as many more as the rest holds at ``pace_s`` seconds a step (evaluations included),
    at least one. Example: 10 minutes, 100 steps in 80 s, 0.9 s a step: 100 + 577 = 677."""
    return step + max(int((minutes * 60 - spent_s) / max(pace_s, 1e-9)), 1)


@dataclass(frozen=True)
class HeadConfig:
    """How to train an eagle head. ``layers`` ``None``: :func:`~adaptive.drafters.eagle.default_layers`.
    ``steps`` ``None``: as many as fit in ``minutes``. ``batch``: windows of ``window`` positions per step.
    ``samples``: continuations decoded per training prompt, the first greedy, the others sampled at
    ``temperature`` (held-out prompts: the greedy one alone, what greedy verification accepts).
    ``intermediate``: the width of the head's MLP (``None``: the target's; a narrower one trains
    faster per step where the target's is wide, e.g. Qwen2.5-1.5B's 8,960)."""

    layers: tuple[int, ...] | None = None
    vocab: int = 8192
    intermediate: int | None = None
    minutes: float = 8.0
    steps: int | None = None
    unroll: int = 3
    batch: int = 4
    window: int = 256
    lr: float = 3e-3
    warmup: int = 50
    new_tokens: int = 96
    samples: int = 1
    temperature: float = SAMPLE_TEMPERATURE
    prompts_per_domain: int | None = None
    held_out: float = 0.1
    generate_batch: int = 32
    eval_every: int = 100
    checkpoint_every: int = 50
    lookup: int = 3
    seed: int = 0

    def __post_init__(self):
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 0):
            raise ConfigError(f"steps must be an integer >= 0 (0 stores the untrained head), got {self.steps!r}")
        if not (self.minutes > 0 and math.isfinite(self.minutes)):
            raise ConfigError(f"--minutes must be a positive number, got {self.minutes}")
        if not 1 <= self.unroll <= len(STEP_WEIGHTS):
            raise ConfigError(f"--unroll must be in 1..{len(STEP_WEIGHTS)}, got {self.unroll}")
        check_training(self, ("vocab", "batch", "window", "new_tokens", "samples", "generate_batch", "eval_every",
                              "checkpoint_every", "lookup"))
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"--temperature must be a positive number, got {self.temperature}")
        if self.intermediate is not None and (not isinstance(self.intermediate, int) or self.intermediate < 1):
            raise ConfigError(f"--head-width must be a positive integer, got {self.intermediate!r}")
        if self.prompts_per_domain is not None and self.prompts_per_domain < 2:
            raise ConfigError(f"prompts-per-domain must be >= 2, got {self.prompts_per_domain}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = None if self.layers is None else list(self.layers)
        return d


def head_shape(bb, cfg: HeadConfig) -> HeadShape:
    """The head's shape for the target ``bb`` (its sizes, the MLP's width unless ``cfg`` sets one, the feature
    layers asked for, the top one included)."""
    layers = cfg.layers if cfg.layers is not None else default_layers(bb.n_layers)
    if bb.n_layers not in layers:
        raise ConfigError(f"the feature layers must include the top one ({bb.n_layers}): the head starts from it "
                          f"and the target's distribution is computed from it; got {list(layers)}")
    mc = bb.config
    theta = getattr(mc, "rope_theta", None) or (getattr(mc, "rope_parameters", None) or {}).get("rope_theta", 1e4)
    width = cfg.intermediate if cfg.intermediate is not None else int(mc.intermediate_size)
    return HeadShape(bb.hidden_size, bb.n_heads, bb.n_kv_heads, bb.head_dim, width,
                     tuple(layers), float(bb.norm_eps), float(theta), cfg.lookup, bb.feature_top)


@torch.inference_mode()
def decode_with_features(bb, prompts: list[list[int]], new_tokens: int, eos: set[int], layers: tuple[int, ...],
                         batch: int = 32, log=lambda m: None, temperature: float = 0.0,
                         seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt with the target's continuation (up to ``new_tokens``, ending at an EOS; greedy at
    ``temperature`` 0, else sampled at it from a generator seeded with ``seed``), and the feature rows of
    every position of it (``[T, len(layers), H]``, bf16 on the host), all from the decoding itself: each
    prompt's prefill and each decoding step write them into its cache. The last token the decoding chose
    is not kept (no forward has fed it, so it has no features)."""
    out: list[tuple[list[int], torch.Tensor]] = []
    gen = torch.Generator(device=bb.device).manual_seed(seed)
    if bb.shared_cache:  # llama.cpp: its sequences and the context's cells bound a group too
        batch = min(batch, bb.sequences)

    def choose(logits: torch.Tensor) -> int:
        if temperature == 0.0:
            return int(logits.argmax())
        return int(torch.multinomial(warp_probs(logits.float(), temperature), 1, generator=gen))

    t0 = time.perf_counter()
    groups, b0 = [], 0
    while b0 < len(prompts):  # as many prompts as fit a batch (and, sharing a context, its free cells)
        room, b1 = (bb.free_positions(collect=True) if bb.shared_cache else None), b0
        while b1 < len(prompts) and b1 - b0 < batch:
            need = len(prompts[b1]) + new_tokens + 1
            if room is not None and b1 > b0 and need > room:
                break
            room = None if room is None else room - need
            b1 += 1
        groups.append(prompts[b0:b1])
        b0 = b1
    for group in groups:
        caches, seqs, pending = [], [], []
        for p in group:
            cache = bb.new_cache(len(p) + new_tokens + 1, features=layers)
            pending.append(choose(bb.forward(torch.tensor(p, device=bb.device), cache, 0).logits[0]))
            caches.append(cache)
            seqs.append(list(p))
        live = list(range(len(group)))
        for _ in range(new_tokens - 1):
            live = [i for i in live if pending[i] not in eos]
            if not live:
                break
            logits = bb.forward_batch([Segment(torch.tensor([pending[i]], device=bb.device), caches[i], len(seqs[i]))
                                       for i in live])
            for i, lg in zip(live, logits):
                seqs[i].append(pending[i])
                pending[i] = choose(lg[0])
        for seq, cache in zip(seqs, caches):
            out.append((seq, cache.features[:len(seq)].to(device="cpu", dtype=torch.bfloat16).clone()))
            cache.release()  # a llama.cpp sequence goes back to the context now
        log(f"decoded {len(out)}/{len(prompts)} prompts' continuations ({time.perf_counter() - t0:.0f} s)")
    return out


@dataclass
class HeadData:
    """Rows of training or evaluation text: per sequence ``s`` its ids, its features (``[T_s, n, H]``), its
    lookup tokens (``[T_s - 1]``), where its answer starts and its domain. Row ``j`` of a sequence reads the
    features at ``j``, the token at ``j + 1`` and its lookup token, and is trained towards the target's
    distribution at ``j + 1`` (from the top feature there)."""

    ids: list[torch.Tensor]
    features: list[torch.Tensor]
    lookups: list[torch.Tensor]
    starts: list[int]
    domains: list[str]

    @classmethod
    def build(cls, decoded: list[tuple[list[int], torch.Tensor]], starts: list[int], domains: list[str],
              n: int) -> HeadData:
        keep = [i for i, (ids, _) in enumerate(decoded) if len(ids) >= 3]
        return cls([torch.tensor(decoded[i][0]) for i in keep], [decoded[i][1] for i in keep],
                   [torch.tensor(lookup_tokens(decoded[i][0], n)) for i in keep], [starts[i] for i in keep],
                   [domains[i] for i in keep])

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def rows(self) -> int:
        return sum(int(t.numel()) - 2 for t in self.ids)

    def window(self, picks: list[int], width: int, gen: torch.Generator | None, device):
        """A batch of windows: ``(features [B, W, n, H], tokens [B, W], lookups [B, W], top [B, W, H],
        labels [B, W], valid [B, W], answer [B, W], prompts)``; ``labels``: the token at ``j + 2`` (-1 past the
        end); ``answer``: rows whose label is in the answer (the target's own greedy tokens); ``prompts``: each
        sequence's prompt ids (a list of ``[P_b]``: its tokens join the head's rows, as a request's do)."""
        B = len(picks)
        n, H = self.features[0].shape[1:]
        feats = torch.zeros(B, width, n, H)
        tokens = torch.zeros(B, width, dtype=torch.long)
        looks = torch.full((B, width), -1, dtype=torch.long)
        top = torch.zeros(B, width, H)
        labels = torch.full((B, width), -1, dtype=torch.long)
        valid = torch.zeros(B, width, dtype=torch.bool)
        answer = torch.zeros(B, width, dtype=torch.bool)
        for b, s in enumerate(picks):
            ids, T = self.ids[s], int(self.ids[s].numel())
            rows = T - 2  # rows 0 .. T-3 have a next feature and a label
            lo = 0 if rows <= width or gen is None else int(torch.randint(0, rows - width + 1, (1,), generator=gen))
            m = min(width, rows)
            r = torch.arange(lo, lo + m)
            feats[b, :m] = self.features[s][r].float()
            tokens[b, :m] = ids[r + 1]
            looks[b, :m] = self.lookups[s][r]
            top[b, :m] = self.features[s][r + 1, -1].float()
            labels[b, :m] = ids[r + 2]
            valid[b, :m] = True
            answer[b, :m] = r + 2 >= self.starts[s]
        prompts = [self.ids[s][:self.starts[s]].to(device) for s in picks]
        return (*(t.to(device) for t in (feats, tokens, looks, top, labels, valid, answer)), prompts)


class HeadTrainer:
    """The optimisation of one :class:`EagleHead` against the target (frozen), over :class:`HeadData`."""

    def __init__(self, bb, shape: HeadShape, vocab_ids: torch.Tensor, cfg: HeadConfig):
        self.bb, self.cfg = bb, cfg
        dev = bb.device
        rows = bb.head_rows(vocab_ids.to(dev)).float()
        with torch.random.fork_rng(devices=[]):  # the layers' initial weights from the run's seed alone
            torch.manual_seed(cfg.seed)
            self.head = EagleHead(shape, vocab_ids.to(dev), rows, bb.final_norm_weight.detach()).to(dev)
        self.norm = bb.final_norm_weight.detach().float()
        self.eps = float(bb.norm_eps)
        self.params = [p for p in self.head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.total: int | None = cfg.steps
        self.history: list[dict] = []
        self.elapsed = 0.0
        bf16 = dev.type == "cuda" or _native_bf16()
        self.autocast = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16)

    def _emb(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.clamp(min=0).reshape(-1)  # the target's rows, wherever its engine keeps them (a table, or the file)
        return self.bb.embed_rows(flat).detach().float().reshape(*ids.shape, -1)

    def rows_for(self, prompts: list[torch.Tensor]):
        """The rows a batch's sequences draft over: the head's own, then the tokens of the batch's prompts
        outside them. For one sequence these are exactly its drafter's rows at run time (the head's joined
        with the request's prompt tokens, :func:`~adaptive.drafters.factory.eagle_vocab`), which
        :meth:`evaluate` measures; a training batch of several shares theirs (a few rows more than each
        one's: unmasked, the target's own distribution puts next to nothing there). ``(ids [V' + E],
        lm [V' + E, H], map [vocab])``: the rows' tokens, their LM-head rows, a token's row (-1: none)."""
        every = torch.cat(prompts) if prompts else self.head.ids[:0]
        rows = eagle_vocab(self.head, self.bb, every.tolist())  # the drafter's own construction
        mapping = torch.full((self.bb.vocab_size,), -1, dtype=torch.long, device=rows.ids.device)
        mapping[rows.ids] = torch.arange(len(rows), device=rows.ids.device)
        return rows.ids, rows.weight, mapping

    def _outputs(self, batch, steps: int):
        feats, tokens, looks, top, labels, valid, answer, prompts = batch
        with torch.autocast(**self.autocast):
            outs = self.head.unrolled(feats, self._emb(tokens), self._emb(looks), looks >= 0, valid, steps)
        ids, lm, mapping = self.rows_for(prompts)
        index = torch.where(looks >= 0, mapping[looks.clamp(min=0)], -1)
        return outs, index, ids, lm

    def _logits(self, g, index, lm) -> torch.Tensor:
        with torch.autocast(**self.autocast):
            return self.head.logits(g, index, lm).float()

    def loss(self, batch) -> torch.Tensor:
        """Weighted forward KL over the unrolled steps, at every row with a label, over the batch's rows
        (the target's distribution renormalised over them)."""
        feats, tokens, looks, top, labels, valid, answer, prompts = batch
        outs, index, _, lm = self._outputs(batch, self.cfg.unroll)
        with torch.no_grad(), torch.autocast(**self.autocast):  # the target's logits in bf16, as it runs
            logp = torch.log_softmax(F.linear(F.rms_norm(top, (top.shape[-1],), self.norm, self.eps), lm).float(), -1)
            p = logp.exp()
        total = 0.0
        for s, g in enumerate(outs):
            mask = labels >= 0
            mask[:, :s] = False  # rows without s target-feature rows before them
            logq = torch.log_softmax(self._logits(g, index, lm), -1)
            kl = (p * (logp - logq)).sum(-1)
            total = total + STEP_WEIGHTS[s] * kl[mask].mean()
        return total

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then a cosine to 0 at the last step (warm-up alone while the length is unknown)."""
        warm = self.cfg.lr * min(1.0, (step + 1) / self.cfg.warmup)
        if self.total is None:
            return warm
        total = max(self.total, 1)
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

    def train_step(self, data: HeadData) -> float:
        picks = torch.multinomial(torch.tensor([float(t.numel()) for t in data.ids]), self.cfg.batch,
                                  replacement=True, generator=self.gen).tolist()
        batch = data.window(picks, self.cfg.window, self.gen, self.bb.device)
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step)
        loss = self.loss(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.step += 1
        return float(loss.detach())

    @torch.no_grad()
    def evaluation(self, held: HeadData, seconds: float) -> dict:
        """The history's record of a held-out evaluation now: :meth:`evaluate` with the step, the training
        seconds so far, and the first draft's acceptance as ``greedy``."""
        ev = self.evaluate(held)
        return {"step": self.step, "seconds": round(seconds, 1), "greedy": ev["positions"][0], **ev}

    def evaluate(self, data: HeadData, steps: int = 3) -> dict:
        """Held-out acceptance per draft position: ``positions[s-1]``, the share of answer rows whose first
        ``s`` drafts all equal the target's greedy tokens, over the mix and ``by_domain``; ``tau``: the
        tokens per verification a chain of ``steps`` drafts would give (1 + their sum); ``interval`` and
        ``domain_intervals``: the first draft's 90% bootstrap interval over the held-out sequences
        (:func:`~adaptive.measure.interval.bootstrap_share`: one prompt's answer keeps far more than
        another's, so a few dozen answers read the mix to a few hundredths), as
        :meth:`~adaptive.profile.Interval.to_dict` writes it, ``None`` where nothing was drafted."""
        self.head.eval()
        hits = defaultdict(lambda: [[0, 0] for _ in range(steps)])  # per draft position: [accepted, drafted]
        firsts = defaultdict(list)  # per domain: each sequence's (first drafts kept, first drafts made)
        for s in range(len(data)):
            width = int(data.ids[s].numel()) - 2
            batch = data.window([s], width, None, self.bb.device)
            outs, index, ids, lm = self._outputs(batch, steps)  # one sequence: its drafter's own rows
            labels = batch[4][0]
            right = [ids[self._logits(g, index, lm).argmax(-1)][0] == labels for g in outs]
            # row j drafts first for the pending token at j + 1; decoding's first draft follows the
            # prefill's token (row start - 1), so the rows before it are never drafted from
            rows = torch.zeros_like(labels, dtype=torch.bool)
            rows[max(data.starts[s] - 1, 0):] = True
            chain = rows.clone()
            for k in range(steps):  # draft k + 1 from row j is row j + k's step k + 1
                drafted = torch.zeros_like(rows)
                drafted[: width - k] = rows[: width - k] & (labels[k:] >= 0)
                kept = torch.zeros_like(rows)
                kept[: width - k] = right[k][k:]
                chain = chain & kept
                counts = int((chain & drafted).sum()), int(drafted.sum())
                for key in (data.domains[s], "all"):
                    hits[key][k][0] += counts[0]
                    hits[key][k][1] += counts[1]
                if k == 0:
                    firsts[data.domains[s]].append(counts)
        self.head.train()

        def rates(c):
            return [round(a / n, 4) if n else 0.0 for a, n in c]

        def interval(pairs):
            if not any(made for _, made in pairs):
                return None
            return bootstrap_share(*zip(*pairs), seed=self.cfg.seed)[1].to_dict()

        positions = rates(hits["all"])
        return {"positions": positions, "tau": round(1 + sum(positions), 4), "rows": hits["all"][0][1],
                "by_domain": {d: rates(c) for d, c in sorted(hits.items()) if d != "all"},
                "interval": interval([p for d in firsts.values() for p in d]),
                "domain_intervals": {d: interval(pairs) for d, pairs in sorted(firsts.items())}}

    def state(self) -> dict:
        return {"head": self.head.state(), "optimizer": self.opt.state_dict(), "generator": self.gen.get_state(),
                "step": self.step, "total": self.total, "history": self.history, "elapsed": self.elapsed}

    def load(self, ck: dict) -> None:
        self.head.load_state_dict(ck["head"])
        self.opt.load_state_dict(ck["optimizer"])
        self.gen.set_state(ck["generator"])
        self.step, self.total, self.history, self.elapsed = ck["step"], ck["total"], ck["history"], ck["elapsed"]


def _native_bf16() -> bool:
    from adaptive.models import cpu_has_native_bf16

    return cpu_has_native_bf16()


def choose_vocab(train: HeadData, held: HeadData, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """``(ids, coverage)``: the head's rows (the ``size`` most frequent ids of the training text, then by
    id; sorted) and the share of the held-out answers' tokens among them."""
    ranked = rank_tokens([t.tolist() for t in train.ids], vocab_size)[:size]
    ids = torch.as_tensor(sorted(ranked.tolist()), dtype=torch.long)
    answers = torch.cat([t[s:] for t, s in zip(held.ids, held.starts)] or [torch.zeros(0, dtype=torch.long)])
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    coverage = float(inside[answers].float().mean()) if answers.numel() else 0.0
    return ids, round(coverage, 4)


def measure_head_cost(bb, head: EagleHead, context: int = 128) -> float:
    """One head draft step as the drafter runs it (:meth:`EagleHead.step` in ``bb``'s dtype and weight
    mode: a row through the head, logits over its rows, the argmax) relative to a full one-token step of
    ``bb``, after ``context`` rows."""
    from adaptive.costs import measure_draft_cost

    dev = bb.device
    step = head.step(*step_settings(bb))
    cache = HeadCache(head.shape, context + 8, dev)
    x = torch.randn(context, head.shape.hidden, device=dev)
    none = torch.zeros(context, dtype=torch.bool, device=dev)
    index = torch.tensor([-1], device=dev)
    with torch.inference_mode():
        g = step.rows(x.to(step.dtype), x, x, none, cache, 0)[-1:]

    def draft(token, position, _cache):
        e = bb.embed_rows(token)
        out = step.rows(g, e, e, none[:1], cache, context)
        return step.logits(out, index).argmax(-1)

    with torch.inference_mode():
        return measure_draft_cost(bb, draft, context=context)
