"""Calibration profiles: the directory the calibrator writes and the runtime loads.

Layout (documented in docs/profile.md)::

    PROFILE/
      profile.json        schema version, model fingerprint, settings, cost model, domains, global set
      anchors.faiss       FAISS IndexFlatL2 over the anchors (unit vectors)
      anchors.json        one domain label per anchor, k, out-of-domain threshold
      embedding_mean.npy  subtracted before normalising (zeros: centring is off by default)
      bigrams.npz         each domain's bigram table for the cascade's statistical drafter
      vocab.npz           each domain's reduced draft vocabulary (token ids)
      distilled.safetensors  trained drafters (``adaptive distill``): the early-exit block, a draft model

``profile.json`` records the SHA-256 of the other files, so a truncated or altered file is
reported as such. A profile is written to a temporary sibling directory and renamed into place:
readers see the old profile or the new one, never a mixture (see :func:`save_profile`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from adaptive.calibrate.costs import CostModel
from adaptive.drafters.cascade import CascadeConfig
from adaptive.drafters.ngram import DEFAULT_PLD_DRAFT_LEN, BigramTable
from adaptive.engine.skip import SkipSet
from adaptive.errors import AdaptiveError, SkipSetError
from adaptive.index.anchors import AnchorIndex, IndexFileError

SCHEMA_VERSION = 1
FORMAT = "adaptive-profile"
BIGRAMS = "bigrams.npz"
VOCAB = "vocab.npz"
DISTILLED = "distilled.safetensors"
OPTIONAL_FILES = (BIGRAMS, VOCAB, DISTILLED)


class ProfileError(AdaptiveError, ValueError):
    """A profile directory is missing, incomplete, corrupt, too new, or made for another model."""


@dataclass(frozen=True)
class DomainProfile:
    """What calibration found for one domain (or the global set over all domains)."""

    name: str
    skip: SkipSet
    draft_len: int
    pays: bool
    prompts: int = 0
    anchors: int = 0
    estimated_matchness: float = 0.0
    estimated_draft_cost: float = 1.0
    estimated_speedup: float = 0.0
    measured_acceptance: float | None = None
    measured_speedup: float | None = None
    measured_mean_accepted: float | None = None
    trials: int = 0
    candidates: tuple = ()
    method: str = ""  # "ar", "ssd", "pld" or "cascade": what the runtime uses; "" -> from ``pays``
    pld_speedup: float | None = None
    pld_acceptance: float | None = None
    pld_draft_len: int = DEFAULT_PLD_DRAFT_LEN
    extra: dict = field(default_factory=dict)
    cascade: CascadeConfig | None = None  # the cascade drafter's settings (None: made before cascades)
    cascade_speedup: float | None = None
    bigram: BigramTable | None = field(default=None, compare=False, repr=False)  # stored in bigrams.npz
    reduced_vocab: bool = False  # draft over ``draft_vocab`` (measured faster than the full head)
    draft_vocab: np.ndarray | None = field(default=None, compare=False, repr=False)  # stored in vocab.npz

    METHODS = ("ar", "ssd", "pld", "cascade")

    def __post_init__(self):
        if self.draft_len < 1 or self.pld_draft_len < 1:
            raise ValueError(f"draft lengths must be >= 1, got {self.draft_len}, {self.pld_draft_len}")
        if self.method and self.method not in self.METHODS:
            raise ValueError(f"method must be one of {', '.join(self.METHODS)}, got {self.method!r}")

    @property
    def decision(self) -> str:
        """What the runtime decodes this domain with: the fastest measured of layer-skip drafting
        (``ssd``), prompt lookup (``pld``) and the cascade (``cascade``) where it beat plain decoding
        by the margin, else ``ar``."""
        return self.method or ("ssd" if self.pays else "ar")

    def to_dict(self) -> dict:
        return {"name": self.name, "skip": self.skip.to_dict(), "skip_text": self.skip.to_text(),
                "draft_len": self.draft_len, "pays": self.pays, "decision": self.decision,
                "prompts": self.prompts, "anchors": self.anchors,
                "estimated_matchness": self.estimated_matchness, "estimated_draft_cost": self.estimated_draft_cost,
                "estimated_speedup": self.estimated_speedup, "measured_acceptance": self.measured_acceptance,
                "measured_speedup": self.measured_speedup, "measured_mean_accepted": self.measured_mean_accepted,
                "trials": self.trials, "candidates": list(self.candidates), "method": self.decision,
                "pld_speedup": self.pld_speedup, "pld_acceptance": self.pld_acceptance,
                "pld_draft_len": self.pld_draft_len, **({"extra": self.extra} if self.extra else {}),
                **({"cascade": self.cascade.to_dict(), "cascade_speedup": self.cascade_speedup}
                   if self.cascade is not None else {}),
                "reduced_vocab": self.reduced_vocab}

    @classmethod
    def from_dict(cls, d: dict, n_layers: int) -> "DomainProfile":
        return cls(name=str(d["name"]), skip=SkipSet.from_dict(d["skip"]).validate_for(n_layers),
                   draft_len=int(d["draft_len"]), pays=bool(d["pays"]), prompts=int(d.get("prompts", 0)),
                   anchors=int(d.get("anchors", 0)), estimated_matchness=float(d.get("estimated_matchness", 0.0)),
                   estimated_draft_cost=float(d.get("estimated_draft_cost", 1.0)),
                   estimated_speedup=float(d.get("estimated_speedup", 0.0)),
                   measured_acceptance=d.get("measured_acceptance"), measured_speedup=d.get("measured_speedup"),
                   measured_mean_accepted=d.get("measured_mean_accepted"), trials=int(d.get("trials", 0)),
                   candidates=tuple(d.get("candidates", ())), method=str(d.get("method", "")),
                   pld_speedup=d.get("pld_speedup"), pld_acceptance=d.get("pld_acceptance"),
                   pld_draft_len=int(d.get("pld_draft_len", DEFAULT_PLD_DRAFT_LEN)), extra=dict(d.get("extra", {})),
                   cascade=CascadeConfig.from_dict(d["cascade"]) if d.get("cascade") else None,
                   cascade_speedup=d.get("cascade_speedup"), reduced_vocab=bool(d.get("reduced_vocab", False)))


@dataclass
class Profile:
    """A loaded (or freshly calibrated) profile."""

    model: dict  # fingerprint: name, model_type, n_layers, config_hash, weights_hash (+ spec, dtype)
    settings: dict
    cost_model: CostModel
    domains: dict[str, DomainProfile]
    global_set: DomainProfile
    index: AnchorIndex
    created: str = ""
    version: str = ""
    path: Path | None = None
    distilled: dict = field(default_factory=dict)  # kind -> what distillation recorded (profile.json)
    distilled_weights: dict = field(default_factory=dict, repr=False)  # kind -> {name: tensor}

    def distilled_drafter(self, kind: str) -> tuple[dict, dict]:
        """``(meta, weights)`` of the drafter ``kind`` trained by ``adaptive distill``, or :class:`ProfileError`."""
        if kind not in self.distilled:
            where = f" {self.path}" if self.path else ""
            raise ProfileError(f"the profile{where} has no distilled {kind} drafter; train one with "
                               f"`adaptive distill --drafter {'early-exit' if kind == 'early-exit' else 'MODEL'}`")
        return self.distilled[kind], self.distilled_weights[kind]

    @property
    def n_layers(self) -> int:
        return int(self.model["n_layers"])

    def domain(self, name: str | None) -> DomainProfile:
        """The domain's profile, or the global one for ``None`` (out-of-domain)."""
        if name is None:
            return self.global_set
        try:
            return self.domains[name]
        except KeyError:
            raise ProfileError(f"the profile has no domain {name!r}; it has {', '.join(sorted(self.domains))}") from None

    def check_model(self, fingerprint: dict) -> None:
        """Raise :class:`ProfileError` unless ``fingerprint`` (``LoadedModel.fingerprint()``) is this profile's model."""
        for key in ("model_type", "n_layers", "config_hash", "weights_hash"):
            if str(fingerprint.get(key)) != str(self.model.get(key)):
                where = f" ({self.path})" if self.path else ""
                raise ProfileError(
                    f"the profile{where} was calibrated for {self.model.get('name')!r} "
                    f"({key} {self.model.get(key)}), not for the loaded model {fingerprint.get('name')!r} "
                    f"({key} {fingerprint.get(key)}); calibrate this model or load the profile's model")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "created": self.created,
                "adaptive_version": self.version, "model": self.model, "settings": self.settings,
                "cost_model": self.cost_model.to_dict(),
                "routing": {"k": self.index.k, "ood_threshold": self.index.ood_threshold,
                            "anchors": len(self.index.labels), "dim": self.index.dim},
                "domains": {n: d.to_dict() for n, d in sorted(self.domains.items())},
                "global": self.global_set.to_dict(),
                **({"distilled": self.distilled} if self.distilled else {})}

    def summary_rows(self) -> list[dict]:
        """One row per domain (then the global set) for tables."""
        rows = []
        for d in [*(self.domains[n] for n in sorted(self.domains)), self.global_set]:
            rows.append({"domain": d.name, "prompts": d.prompts, "anchors": d.anchors,
                         "skip_attn": len(d.skip.attn), "skip_mlp": len(d.skip.mlp), "draft_len": d.draft_len,
                         "est_acceptance": d.estimated_matchness, "meas_acceptance": d.measured_acceptance,
                         "est_speedup": d.estimated_speedup, "meas_speedup": d.measured_speedup,
                         "pld_speedup": d.pld_speedup, "cascade_speedup": d.cascade_speedup,
                         "draft_vocab": len(d.draft_vocab) if d.reduced_vocab and d.draft_vocab is not None else None,
                         "decision": d.decision, "skip": d.skip.to_text()})
        return rows


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_writable(out: Path) -> None:
    """Refuse an output path that exists and is not a profile (nothing of the user's is overwritten)."""
    out = Path(out)
    if out.exists() and (out.is_file() or (any(out.iterdir()) and not (out / "profile.json").exists())):
        raise ProfileError(f"{out}: exists and is not a profile; choose another --out or remove it")


def save_profile(profile: Profile, out: str | Path) -> Path:
    """Write ``profile`` to ``out`` atomically and return the path.

    An existing profile at ``out`` is replaced: it is renamed aside, the new one renamed into place,
    then the old one deleted (put back if the second rename fails). Between the two renames, a
    few microseconds, ``out`` does not exist. Any other existing non-empty directory or file is
    refused (:class:`ProfileError`) rather than overwritten.
    """
    out = Path(out)
    check_writable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old = None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a profile is shared like any directory
        profile.index.save(tmp)
        data = profile.to_dict()
        names = list(AnchorIndex.FILES) + [kind for kind in (BIGRAMS, VOCAB) if _save_tables(kind, profile, data, tmp / kind)]
        if profile.distilled_weights:
            _save_distilled(profile, tmp / DISTILLED)
            names.append(DISTILLED)
        data["files"] = {name: _sha256(tmp / name) for name in names}
        with open(tmp / "profile.json", "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        for name in names:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}-{int(time.time() * 1e6)}"
            os.rename(out, old)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        if old is not None and not out.exists():
            os.rename(old, out)  # put the previous profile back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    profile.path = out
    return out


def _save_distilled(profile: Profile, path: Path) -> None:
    """Every distilled drafter's tensors in one safetensors file, keyed ``KIND/NAME``."""
    from safetensors.torch import save_file

    missing = set(profile.distilled) ^ set(profile.distilled_weights)
    if missing:
        raise ValueError(f"distilled drafters without weights or without a record: {sorted(missing)}")
    flat = {f"{kind}/{name}": t.detach().to("cpu").contiguous()
            for kind, state in profile.distilled_weights.items() for name, t in state.items()}
    save_file(flat, str(path))


def _load_distilled(path: Path, kinds) -> dict:
    from safetensors.torch import load_file

    f = path / DISTILLED
    if not kinds:
        return {}
    if not f.is_file():
        raise ProfileError(f"{f}: missing from the profile")
    try:
        flat = load_file(str(f))
    except Exception as exc:  # safetensors raises its own error types
        raise ProfileError(f"{f}: unreadable ({type(exc).__name__}: {exc})") from None
    out = {k: {} for k in kinds}
    for key, t in flat.items():
        kind, _, name = key.partition("/")
        if kind in out:
            out[kind][name] = t
    empty = [k for k, v in out.items() if not v]
    if empty:
        raise ProfileError(f"{f}: holds no weights for the distilled {', '.join(empty)} drafter")
    return out


def _table_arrays(kind: str, dp: DomainProfile) -> dict[str, np.ndarray] | None:
    if kind == BIGRAMS:
        t = dp.bigram
        return None if t is None else {"keys": t.keys.astype(np.int32), "succ": t.succ.astype(np.int32),
                                       "prob": t.prob.astype(np.float16)}
    return None if dp.draft_vocab is None else {"ids": np.asarray(dp.draft_vocab).astype(np.int32)}


def _save_tables(kind: str, profile: Profile, data: dict, path: Path) -> bool:
    """Write every domain's table of ``kind`` (``bigrams.npz``: ``i_keys``, ``i_succ``, ``i_prob``;
    ``vocab.npz``: ``i_ids``) into one ``.npz`` and record each entry number in ``data``
    (``bigram`` / ``draft_vocab``: ``{"entry": i, "entries": rows}``); ``False`` when no domain has one."""
    key = "bigram" if kind == BIGRAMS else "draft_vocab"
    arrays = {}
    entries = [(data["domains"][n], d) for n, d in sorted(profile.domains.items())] + [(data["global"], profile.global_set)]
    for i, (entry, dp) in enumerate(entries):
        a = _table_arrays(kind, dp)
        if a is not None:
            entry[key] = {"entry": i, "entries": int(next(iter(a.values())).shape[0])}
            arrays.update({f"{i}_{name}": arr for name, arr in a.items()})
    if not arrays:
        return False
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)
    return True


def _load_tables(kind: str, path: Path, entries: dict) -> dict:
    """The tables of ``kind`` referenced by ``entries`` (domain name -> its profile.json entry)."""
    key = "bigram" if kind == BIGRAMS else "draft_vocab"
    wanted = {n: e[key] for n, e in entries.items() if isinstance(e.get(key), dict)}
    if not wanted:
        return {}
    f = path / kind
    if not f.is_file():
        raise ProfileError(f"{f}: missing from the profile")
    try:
        with np.load(f, allow_pickle=False) as z:
            out = {}
            for name, ref in wanted.items():
                i = int(ref["entry"])
                if kind == BIGRAMS:
                    out[name] = BigramTable(z[f"{i}_keys"], z[f"{i}_succ"], z[f"{i}_prob"].astype(np.float32))
                else:
                    out[name] = z[f"{i}_ids"].astype(np.int64)
                    if out[name].ndim != 1 or out[name].min(initial=0) < 0 or np.unique(out[name]).size != out[name].size:
                        raise ValueError(f"entry {i} is not a list of distinct token ids")
                if len(out[name]) != int(ref.get("entries", len(out[name]))):
                    raise ValueError(f"entry {i} has {len(out[name])} rows, profile.json says {ref['entries']}")
            return out
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ProfileError(f"{f}: unreadable or inconsistent ({type(exc).__name__}: {exc})") from None


def load_profile(path: str | Path) -> Profile:
    """Load and verify a profile directory; every problem is a :class:`ProfileError` naming the file."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"{path}: no such profile directory")
    if not path.is_dir():
        raise ProfileError(f"{path}: a profile is a directory (written by `adaptive calibrate`)")
    pj = path / "profile.json"
    if not pj.is_file():
        raise ProfileError(f"{pj}: missing; {path} is not a complete profile")
    try:
        data = json.loads(pj.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{pj}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{pj}: not an adaptive profile")
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise ProfileError(f"{pj}: no schema_version")
    if version > SCHEMA_VERSION:
        raise ProfileError(f"{pj}: schema version {version} is newer than this adaptive reads ({SCHEMA_VERSION}); upgrade adaptive")
    if version < 1:
        raise ProfileError(f"{pj}: unknown schema version {version}")
    files = data.get("files", {})
    for name in [*AnchorIndex.FILES, *(n for n in OPTIONAL_FILES if n in files)]:
        f = path / name
        if not f.is_file():
            raise ProfileError(f"{f}: missing from the profile")
        if name in files and _sha256(f) != files[name]:
            raise ProfileError(f"{f}: does not match its checksum in profile.json (truncated or altered)")
    try:
        index = AnchorIndex.load(path)
    except IndexFileError as exc:
        raise ProfileError(str(exc)) from None
    try:
        model = dict(data["model"])
        n_layers = int(model["n_layers"])
        domains = {n: DomainProfile.from_dict(d, n_layers) for n, d in data["domains"].items()}
        glob = DomainProfile.from_dict(data["global"], n_layers)
        entries = {**{n: data["domains"][n] for n in domains}, None: data["global"]}
        bigrams, vocab = _load_tables(BIGRAMS, path, entries), _load_tables(VOCAB, path, entries)
        domains = {n: replace(d, bigram=bigrams.get(n), draft_vocab=vocab.get(n)) for n, d in domains.items()}
        glob = replace(glob, bigram=bigrams.get(None), draft_vocab=vocab.get(None))
        costs = CostModel.from_dict(data["cost_model"])
        settings = dict(data.get("settings", {}))
        distilled = dict(data.get("distilled", {}))
        weights = _load_distilled(path, list(distilled))
    except ProfileError:
        raise
    except (KeyError, TypeError, ValueError, SkipSetError) as exc:
        raise ProfileError(f"{pj}: malformed ({type(exc).__name__}: {exc})") from None
    missing = set(index.labels) - set(domains)
    if missing:
        raise ProfileError(f"{pj}: anchors labelled {sorted(missing)} have no domain entry")
    return Profile(model=model, settings=settings, cost_model=costs, domains=domains, global_set=glob,
                   index=index, created=str(data.get("created", "")), version=str(data.get("adaptive_version", "")),
                   path=path, distilled=distilled, distilled_weights=weights)
