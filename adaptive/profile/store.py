"""Reading and writing profiles: the directory the calibrator writes and the runtime loads.

Layout (documented in docs/profile.md)::

    PROFILE/
      profile.json        schema version, model fingerprint, settings, cost model, domains, global set
      anchors.faiss       FAISS IndexFlatL2 over the anchors (unit vectors)
      anchors.json        one domain label per anchor, k, out-of-domain threshold
      embedding_mean.npy  subtracted before normalising (zeros: centring is off by default)
      bigrams.npz         each domain's bigram table for the cascade's statistical drafter
      vocab.npz           each domain's reduced draft vocabulary (token ids)
      distilled.safetensors  trained drafters (``adaptive distill``): the early-exit block, a draft model
      lexicon.npz         the domains' TF-IDF centroids over token ids (adaptive.index.lexicon)

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
from dataclasses import replace
from pathlib import Path

import numpy as np

from adaptive.codec import from_json, to_json
from adaptive.costs import CostModel
from adaptive.drafters.ngram import BigramTable
from adaptive.errors import ConfigError, SkipSetError
from adaptive.index.anchors import AnchorIndex, IndexFileError
from adaptive.index.lexicon import Lexicon
from adaptive.profile.engines import is_two_engine, member_dir
from adaptive.profile.records import (
    DistilledRecord,
    DomainRecord,
    MeasureSettings,
    ModelFingerprint,
    Profile,
    ProfileError,
    RuntimeSettings,
)
from adaptive.workdir import fsync_dir

SCHEMA_VERSION = 2  # 2: typed records (adaptive.profile.records); 1: before them, not readable (recalibrate)
FORMAT = "adaptive-profile"
BIGRAMS = "bigrams.npz"
VOCAB = "vocab.npz"
DISTILLED = "distilled.safetensors"
LEXICON = "lexicon.npz"
OPTIONAL_FILES = (BIGRAMS, VOCAB, DISTILLED, LEXICON)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def profile_json(profile: Profile) -> dict:
    """``profile.json``'s content (without the file checksums and table references added on save)."""
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "created": profile.created,
            "adaptive_version": profile.version, "model": to_json(profile.model),
            "settings": {**profile.calibration, **to_json(profile.settings)},
            "runtime": to_json(profile.runtime), "cost_model": profile.cost_model.to_dict(),
            "routing": {"k": profile.index.k, "ood_threshold": profile.index.ood_threshold,
                        "ood_thresholds": {d: round(t, 6) for d, t in sorted(profile.index.ood_thresholds.items())},
                        "anchors": len(profile.index.labels), "dim": profile.index.dim,
                        "pooling": profile.index.pooling.to_dict()},
            "domains": {n: to_json(d) for n, d in sorted(profile.domains.items())},
            "global": to_json(profile.global_set),
            **({"distilled": {k: to_json(r) for k, r in profile.distilled.items()}} if profile.distilled else {})}


def check_writable(out: Path) -> None:
    """Refuse an output path that exists and is not a profile (nothing of the user's is overwritten)."""
    out = Path(out)
    if out.exists() and (out.is_file() or (any(out.iterdir()) and not (out / "profile.json").exists()
                                           and not is_two_engine(out))):
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
        data = profile_json(profile)
        names = list(AnchorIndex.FILES) + [kind for kind in (BIGRAMS, VOCAB)
                                           if _save_tables(kind, profile, data, tmp / kind)]
        if profile.distilled_weights:
            _save_distilled(profile, tmp / DISTILLED)
            names.append(DISTILLED)
        if profile.lexicon is not None:
            with open(tmp / LEXICON, "wb") as f:
                np.savez_compressed(f, **profile.lexicon.to_arrays())
            names.append(LEXICON)
        data["files"] = {name: _sha256(tmp / name) for name in names}
        with open(tmp / "profile.json", "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        for name in names:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}-{int(time.time() * 1e6)}"
            os.rename(out, old)
        os.rename(tmp, out)
        fsync_dir(out.parent)
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


def _load_lexicon(path: Path, files: dict) -> Lexicon | None:
    """The profile's lexicon where ``profile.json`` lists one (its checksum already checked)."""
    if LEXICON not in files:
        return None
    f = path / LEXICON
    try:
        with np.load(f, allow_pickle=False) as z:
            return Lexicon.from_arrays(z)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ProfileError(f"{f}: unreadable or inconsistent ({type(exc).__name__}: {exc})") from None


def _table_arrays(kind: str, dp: DomainRecord) -> dict[str, np.ndarray] | None:
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
    entries = ([(data["domains"][n], d) for n, d in sorted(profile.domains.items())]
               + [(data["global"], profile.global_set)])
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
                    out[name] = ids = z[f"{i}_ids"].astype(np.int64)
                    if ids.ndim != 1 or ids.min(initial=0) < 0 or np.unique(ids).size != ids.size:
                        raise ValueError(f"entry {i} is not a list of distinct token ids")
                if len(out[name]) != int(ref.get("entries", len(out[name]))):
                    raise ValueError(f"entry {i} has {len(out[name])} rows, profile.json says {ref['entries']}")
            return out
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ProfileError(f"{f}: unreadable or inconsistent ({type(exc).__name__}: {exc})") from None


def load_profile(path: str | Path, engine: str | None = None) -> Profile:
    """Load and verify a profile directory; every problem is a :class:`ProfileError` naming the file.
    A two-engine profile (:mod:`adaptive.profile.engines`) loads its member of ``engine`` (``None``:
    its default member)."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"{path}: no such profile directory")
    path = member_dir(path, engine)
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
        raise ProfileError(f"{pj}: schema version {version} is newer than this adaptive reads ({SCHEMA_VERSION}); "
                           "upgrade adaptive")
    if version < 1:
        raise ProfileError(f"{pj}: unknown schema version {version}")
    if version < SCHEMA_VERSION:
        raise ProfileError(f"{pj}: schema version {version} was written by an earlier adaptive "
                           "and is not read any more; calibrate again "
                           f"(adaptive calibrate ... --out {path})")
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
        model = ModelFingerprint.from_dict(data["model"])
        refs = {"bigram", "draft_vocab"}  # references into the .npz files, read below
        domains = {n: from_json(DomainRecord, {k: v for k, v in d.items() if k not in refs}, f"domain {n}")
                   for n, d in data["domains"].items()}
        glob = from_json(DomainRecord, {k: v for k, v in data["global"].items() if k not in refs}, "global")
        for d in [*domains.values(), glob]:
            d.layer_skip.skip.validate_for(model.n_layers)
        entries = {**{n: data["domains"][n] for n in domains}, None: data["global"]}
        bigrams, vocab = _load_tables(BIGRAMS, path, entries), _load_tables(VOCAB, path, entries)
        domains = {n: replace(d, bigram=bigrams.get(n), draft_vocab=vocab.get(n)) for n, d in domains.items()}
        glob = replace(glob, bigram=bigrams.get(None), draft_vocab=vocab.get(None))
        costs = CostModel.from_dict(data["cost_model"])
        runtime = RuntimeSettings.from_dict(data.get("runtime", {}))
        distilled = {k: from_json(DistilledRecord, r, f"distilled {k}") for k, r in data.get("distilled", {}).items()}
        weights = _load_distilled(path, list(distilled))
        lexicon = _load_lexicon(path, files)
    except ProfileError:
        raise
    except (KeyError, TypeError, ValueError, SkipSetError) as exc:
        raise ProfileError(f"{pj}: malformed ({type(exc).__name__}: {exc})") from None
    settings, calibration = _measure_settings(pj, data.get("settings", {}))
    missing = set(index.labels) - set(domains)
    if missing:
        raise ProfileError(f"{pj}: anchors labelled {sorted(missing)} have no domain entry")
    unknown = set(lexicon.names) - set(domains) if lexicon is not None else set()
    if unknown:
        raise ProfileError(f"{path / LEXICON}: domains {sorted(unknown)} have no domain entry")
    return Profile(model=model, settings=settings, runtime=runtime, cost_model=costs, domains=domains, global_set=glob,
                   index=index, created=str(data.get("created", "")), version=str(data.get("adaptive_version", "")),
                   path=path, distilled=distilled, distilled_weights=weights, calibration=calibration,
                   lexicon=lexicon)


def _measure_settings(pj: Path, recorded) -> tuple[MeasureSettings, dict]:
    """``profile.json``'s ``settings`` split (:meth:`MeasureSettings.split`); a key missing takes its
    default (profiles written before it existed), a malformed value is a :class:`ProfileError`
    naming the file and the key."""
    try:
        return MeasureSettings.split(recorded)
    except ConfigError as exc:
        raise ProfileError(f"{pj}: settings.{exc.key}: {exc}") from None
    except ValueError as exc:
        raise ProfileError(f"{pj}: {exc}") from None
