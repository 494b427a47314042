"""What decides a calibration's result: :class:`CalibrationSettings`, the domains, the work directory."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from adaptive.calibrate.search import SPACES
from adaptive.engine.config import POOL_MODES, Pooling
from adaptive.errors import AdaptiveError, ConfigError
from adaptive.profile import GLOBAL, MeasureSettings, RuntimeSettings
from adaptive.workdir import WorkDir

BACKENDS = ("loky", "threading", "dask", "ray")
MIN_PROMPTS = 3
# The calibration task over all domains, whose record becomes the profile's global record
# (``adaptive.profile.GLOBAL``). A distinct string on purpose: it names the task's files in the
# calibration work directory and seeds its search, so renaming it would stop old runs resuming.
GLOBAL_TASK = "__global__"


class CalibrationError(AdaptiveError):
    """A calibration cannot start or resume (locked output, mismatched checkpoint, bad domains)."""


_M, _R = MeasureSettings, RuntimeSettings  # the defaults of the settings recorded for the runtime are theirs


@dataclass(frozen=True)
class CalibrationSettings:
    """Everything that decides a calibration's result. Validated on construction. The fields
    :class:`~adaptive.profile.MeasureSettings` has (how a domain's drafters are measured, recorded
    in the profile for the runtime) take their defaults and checks from it; :attr:`measure` is that record.
    Those of :class:`~adaptive.profile.RuntimeSettings` take their defaults from it (:attr:`runtime`)."""

    prompts_per_domain: int = 16
    anchors_per_domain: int = _M.anchors_per_domain
    trials: int = 30
    init_trials: int = 6
    space: str = "ranked"
    continuation_tokens: int = 32
    confirm_prompts: int = _M.confirm_prompts
    confirm_tokens: int = _M.confirm_tokens
    block_tokens: int = _M.block_tokens
    min_blocks: int = _M.min_blocks
    min_prompts: int = _M.min_prompts
    interval_level: float = _M.interval_level
    acceptance_floor: float = _M.acceptance_floor
    time_gate: float = 0.95  # a skip set is timed only when its estimated speedup reaches this
    max_draft_len: int = _R.max_draft_len
    pld_draft_len: int = _R.pld_draft_len
    min_gain: float = _M.min_gain
    bigram_min_count: int = _M.bigram_min_count
    cascade_max_split: int = 2
    cascade_max_draft_len: int = _R.cascade_max_draft_len
    cascade_lenience: float = _M.cascade_lenience
    vocab_sizes: tuple = (1024, 2048, 4096, 8192, 16384)  # reduced draft heads tried (empty: full head only)
    route_k: int = 5
    pool_depth: float = 1 / 3  # the routing embedding: the residual stream after this share of the layers ...
    pool_mode: str = "last"  # ... at the prompt's last position (docs/results.md: routing study)
    # other depths whose last position and mean calibration compares with that default by held-out routing
    # accuracy on its own prompts (adaptive.index.choice), keeping the best; () keeps the default
    pool_choices: tuple = (0.2, 0.5, 2 / 3, 0.85)
    cost_context: int = 128
    chat: bool | None = _R.chat
    seed: int = _M.seed

    def __post_init__(self):
        positive = ("prompts_per_domain", "trials", "continuation_tokens", "max_draft_len", "pld_draft_len",
                    "route_k", "cost_context", "cascade_max_draft_len")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
        _ = self.measure  # the measurement fields are checked by their record
        if self.prompts_per_domain < MIN_PROMPTS:
            raise ConfigError(f"prompts-per-domain must be at least {MIN_PROMPTS}, got {self.prompts_per_domain}")
        if not 0 <= self.init_trials <= self.trials:
            raise ConfigError(f"init-trials must be between 0 and trials ({self.trials}), got {self.init_trials}")
        if self.space not in SPACES:
            raise ConfigError(f"space must be one of {', '.join(SPACES)}, got {self.space!r}")
        if self.max_draft_len > 64:
            raise ConfigError("max-draft-len must be at most 64")
        if not 0 < self.pool_depth <= 1:
            raise ConfigError(f"pool-depth must be in (0, 1], got {self.pool_depth}")
        if self.pool_mode not in POOL_MODES:
            raise ConfigError(f"pool-mode must be one of {', '.join(POOL_MODES)}, got {self.pool_mode!r}")
        object.__setattr__(self, "pool_choices", tuple(self.pool_choices))
        if any(not 0 < d < 1 for d in self.pool_choices):
            raise ConfigError(f"pool choices must be depths in (0, 1), got {self.pool_choices}")
        if not self.time_gate >= 0:
            raise ConfigError(f"time-gate must be >= 0 (0: time every skip set found), got {self.time_gate}")
        self._check_cascade_and_vocab()

    def _check_cascade_and_vocab(self) -> None:
        if self.cascade_max_draft_len > 64:
            raise ConfigError("cascade-max-draft-len must be at most 64")
        if not isinstance(self.cascade_max_split, int) or not 0 <= self.cascade_max_split <= self.cascade_max_draft_len:
            raise ConfigError("cascade-max-split must be in 0 .. cascade-max-draft-len, "
                              f"got {self.cascade_max_split!r}")
        sizes = tuple(self.vocab_sizes)
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 16 for v in sizes) or len(set(sizes)) != len(sizes):
            raise ConfigError(f"vocab-sizes must be distinct integers >= 16, got {list(sizes)}")
        object.__setattr__(self, "vocab_sizes", tuple(sorted(sizes)))

    @classmethod
    def quick(cls, **overrides) -> CalibrationSettings:
        """The README preset: a few minutes on 2 CPU cores for the built-in domains."""
        base = dict(prompts_per_domain=6, anchors_per_domain=6, trials=10, init_trials=4, continuation_tokens=24,
                    confirm_prompts=4, confirm_tokens=48, min_blocks=4)
        return cls(**{**base, **overrides})

    @property
    def measure(self) -> MeasureSettings:
        """How this calibration measures a domain's drafters: the profile's ``settings`` record."""
        return MeasureSettings(**{f.name: getattr(self, f.name) for f in fields(MeasureSettings)})

    @property
    def runtime(self) -> RuntimeSettings:
        """What the runtime takes from this calibration: the profile's ``runtime`` record."""
        return RuntimeSettings(**{f.name: getattr(self, f.name) for f in fields(RuntimeSettings)})

    @property
    def race_blocks(self) -> int:
        """The most paired blocks a domain's race times: ``confirm_prompts`` prompts of
        ``confirm_tokens - 1`` tokens after the prefill's first, in blocks of ``block_tokens``."""
        return self.confirm_prompts * -(-(self.confirm_tokens - 1) // self.block_tokens)

    def pooling(self, n_layers: int) -> Pooling:
        """The routing embedding for a model of ``n_layers``: e.g. the last position after 10 of 30 layers."""
        return Pooling(max(1, min(n_layers, round(n_layers * self.pool_depth))), self.pool_mode)

    def pooling_candidates(self, n_layers: int) -> tuple[Pooling, ...]:
        """The default :meth:`pooling` first, then the last position and the mean after each of
        ``pool_choices`` (layers before the last, no repeats). Example, 30 layers: last@10, mean@10,
        last@6, mean@6, last@15, mean@15, last@20, mean@20, last@26, mean@26."""
        out = [self.pooling(n_layers)]
        for depth in (self.pool_depth, *self.pool_choices) if self.pool_choices else ():
            layer = max(1, min(n_layers - 1, round(n_layers * depth)))
            for mode in POOL_MODES[::-1]:  # last, mean
                if Pooling(layer, mode) not in out:
                    out.append(Pooling(layer, mode))
        return tuple(out)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["vocab_sizes"] = list(self.vocab_sizes)  # as JSON reads it back: a resumed run compares equal
        d["pool_choices"] = list(self.pool_choices)
        return d


def check_domains(domains: dict[str, list[str]], settings: CalibrationSettings) -> dict[str, list[str]]:
    """The prompts actually used: the first ``prompts_per_domain`` of each domain (in file order)."""
    if not domains:
        raise ConfigError("no domains to calibrate")
    for reserved in (GLOBAL_TASK, GLOBAL):
        if reserved in domains:
            raise ConfigError(f"{reserved!r} is reserved for the global skip set; rename that domain")
    out = {}
    for name, prompts in domains.items():
        prompts = [p for p in prompts if isinstance(p, str) and p.strip()]
        if len(prompts) < MIN_PROMPTS:
            raise ConfigError(f"domain {name!r} has {len(prompts)} prompt(s); calibration needs at least {MIN_PROMPTS}")
        out[name] = prompts[: settings.prompts_per_domain]
    return out


def domains_digest(domains: dict[str, list[str]]) -> str:
    """A short hash of the domains' names and prompts (what a resumed calibration must match)."""
    h = hashlib.sha256()
    for name in sorted(domains):
        h.update(name.encode() + b"\0")
        for p in domains[name]:
            h.update(p.encode() + b"\1")
    return h.hexdigest()[:16]


def calibration_workdir(out: str | Path) -> WorkDir:
    """``OUT.work/``: the checkpoints of the calibration writing the profile ``out``."""
    return WorkDir(Path(str(out) + ".work"), "calibration", CalibrationError, busy_hint=" or choose another --out")
