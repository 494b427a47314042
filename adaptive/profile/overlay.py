"""The online overlay: what a runtime learned from the traffic it served, saved beside its profile.

A calibrated profile is never edited in place. What the runtime learns while serving (issue 20:
:mod:`adaptive.runtime.online`) is kept in one file next to it, ``PROFILE.online`` by default::

    {"format": "adaptive-online", "version": 1, "bytes": N, "sha256": "..."}\\n   one JSON header line
    <N bytes: a NumPy .npz archive>                                                the state

The archive holds ``meta`` (UTF-8 JSON: the profile it belongs to, the save's generation and
time, the bandits' posteriors, the learned domains' records, the buffer's token ids) and the arrays:
each table's bigram counts (``counts/I/prev``, ``succ``, ``count``), the out-of-domain buffer's
embeddings (``buffer/vectors``) and each learned domain's anchors (``learned/I/anchors``).

Writes are atomic (a temporary sibling, fsynced, renamed over the file, the directory fsynced):
a process killed while saving leaves the previous complete overlay, never a torn one. The header's
checksum catches a file damaged afterwards; a damaged, foreign or newer overlay is an
:class:`OverlayError` naming the file, and the profile itself is never touched by any of this.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adaptive.codec import from_json, to_json
from adaptive.errors import AdaptiveError
from adaptive.profile.records import DomainRecord
from adaptive.workdir import atomic_write, fsync_dir

OVERLAY_FORMAT = "adaptive-online"
OVERLAY_VERSION = 1
SUFFIX = ".online"


class OverlayError(AdaptiveError, ValueError):
    """An online overlay is truncated, corrupt, of another format or version, or of another profile."""


def overlay_path(profile_dir: str | Path) -> Path:
    """Where a profile's overlay lives by default: ``PROFILE.online`` beside the directory."""
    p = Path(profile_dir)
    return p.with_name(p.name + SUFFIX)


def profile_digest(profile_dir: str | Path) -> str:
    """The SHA-256 of the profile's ``profile.json`` (which checksums every other file): what an
    overlay belongs to. A recalibrated profile has another digest, so its old overlay is not applied."""
    return hashlib.sha256((Path(profile_dir) / "profile.json").read_bytes()).hexdigest()


@dataclass(frozen=True, eq=False)
class PairCounts:
    """Decayed counts of adjacent token pairs ``(prev, succ)`` seen in accepted output: ``[n]`` each."""

    prev: np.ndarray
    succ: np.ndarray
    count: np.ndarray

    def __post_init__(self):
        arrays = [np.asarray(a) for a in (self.prev, self.succ, self.count)]
        if any(a.ndim != 1 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:
            raise ValueError("pair counts need three 1-D arrays of one length")
        if arrays[0].size and (min(arrays[0].min(), arrays[1].min()) < 0 or not np.all(arrays[2] > 0)):
            raise ValueError("pair counts need non-negative token ids and positive counts")
        object.__setattr__(self, "prev", arrays[0].astype(np.int64))
        object.__setattr__(self, "succ", arrays[1].astype(np.int64))
        object.__setattr__(self, "count", arrays[2].astype(np.float32))

    def __len__(self) -> int:
        return int(self.prev.shape[0])


@dataclass(frozen=True, eq=False)
class BufferedRequest:
    """An out-of-domain request kept for domain discovery: its pooled embedding ``[d]`` (raw, as the
    index transforms it), its prompt's and its output's token ids."""

    vector: np.ndarray
    prompt: tuple[int, ...]
    output: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class LearnedDomain:
    """A domain discovered in traffic and measured: its ``anchors`` ``[m, d]`` (unit vectors, as the
    index's), its :class:`~adaptive.profile.DomainRecord` (decision raced against ``ar``), how many
    buffered requests formed it. (A domain still being measured is not saved: its requests stay in
    the buffer.)"""

    name: str
    anchors: np.ndarray
    record: DomainRecord
    members: int
    created: str = ""


@dataclass(frozen=True, eq=False)
class OnlineOverlay:
    """What a runtime learned, as saved: ``profile``: the digest of the profile it belongs to;
    ``generation``: saves so far; ``requests``: requests observed; ``counts``: each table's pair
    counts (a calibrated domain, ``global``, or a learned domain); ``bandits``: each ``"policy:domain"``
    bandit's posteriors; ``buffer``: out-of-domain requests not yet in a learned domain; ``learned``."""

    profile: str
    generation: int = 0
    saved: str = ""
    requests: int = 0
    counts: dict[str, PairCounts] = field(default_factory=dict)
    bandits: dict[str, dict] = field(default_factory=dict)
    buffer: tuple[BufferedRequest, ...] = ()
    learned: tuple[LearnedDomain, ...] = ()

    def summary(self) -> dict:
        """What ``adaptive profile show`` prints: sizes and the learned domains' decisions."""
        return {"generation": self.generation, "saved": self.saved, "requests": self.requests,
                "tables": {n: {"pairs": len(c), "tokens": round(float(c.count.sum()), 1)}
                           for n, c in sorted(self.counts.items())},
                "bandits": sorted(self.bandits), "buffered": len(self.buffer),
                "learned": [{"name": d.name, "members": d.members, "anchors": int(d.anchors.shape[0]),
                             "created": d.created, "decision": d.record.decision.drafter,
                             "speedup": d.record.decision.speedup} for d in self.learned]}


def encode_overlay(ov: OnlineOverlay) -> bytes:
    """The overlay's file content (header line and archive)."""
    arrays: dict[str, np.ndarray] = {}
    tables = []
    for i, (name, c) in enumerate(sorted(ov.counts.items())):
        tables.append(name)
        arrays.update({f"counts/{i}/prev": c.prev.astype(np.int32), f"counts/{i}/succ": c.succ.astype(np.int32),
                       f"counts/{i}/count": c.count.astype(np.float32)})
    if ov.buffer:
        arrays["buffer/vectors"] = np.stack([b.vector.astype(np.float32) for b in ov.buffer])
    learned = []
    for i, d in enumerate(ov.learned):
        arrays[f"learned/{i}/anchors"] = d.anchors.astype(np.float32)
        learned.append({"name": d.name, "members": d.members, "created": d.created,
                        "record": to_json(d.record)})
    meta = {"profile": ov.profile, "generation": ov.generation, "saved": ov.saved, "requests": ov.requests,
            "tables": tables, "bandits": ov.bandits, "learned": learned,
            "buffer": [{"prompt": list(b.prompt), "output": list(b.output)} for b in ov.buffer]}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    body = io.BytesIO()
    np.savez(body, **arrays)
    data = body.getvalue()
    header = {"format": OVERLAY_FORMAT, "version": OVERLAY_VERSION, "bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest()}
    return (json.dumps(header) + "\n").encode() + data


def decode_overlay(data: bytes, where: str = "overlay") -> OnlineOverlay:
    """Parse :func:`encode_overlay`'s bytes; every problem is an :class:`OverlayError` naming ``where``."""
    line, sep, body = data.partition(b"\n")
    try:
        header = json.loads(line.decode()) if sep else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != OVERLAY_FORMAT:
        raise OverlayError(f"{where}: not an adaptive online overlay")
    version = header.get("version")
    if not isinstance(version, int) or version > OVERLAY_VERSION or version < 1:
        raise OverlayError(f"{where}: overlay version {version!r} is not one this adaptive reads ({OVERLAY_VERSION}); "
                           "upgrade adaptive or remove it (adaptive profile reset-online)")
    if len(body) != header.get("bytes") or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise OverlayError(f"{where}: does not match its checksum (truncated or altered); "
                           "remove it with `adaptive profile reset-online`")
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            counts = {name: PairCounts(z[f"counts/{i}/prev"], z[f"counts/{i}/succ"], z[f"counts/{i}/count"])
                      for i, name in enumerate(meta["tables"])}
            entries = meta["buffer"]
            vectors = z["buffer/vectors"] if entries else np.zeros((0, 0), np.float32)
            if len(vectors) != len(entries):
                raise ValueError(f"{len(vectors)} buffered embeddings for {len(entries)} requests")
            buffer = tuple(BufferedRequest(vectors[i].copy(), tuple(int(t) for t in e["prompt"]),
                                           tuple(int(t) for t in e["output"])) for i, e in enumerate(entries))
            learned = tuple(LearnedDomain(d["name"], z[f"learned/{i}/anchors"].copy(),
                                          from_json(DomainRecord, d["record"], f"learned domain {d['name']}"),
                                          int(d["members"]), d.get("created", ""))
                            for i, d in enumerate(meta["learned"]))
            return OnlineOverlay(str(meta["profile"]), int(meta["generation"]), str(meta.get("saved", "")),
                                 int(meta.get("requests", 0)), counts, dict(meta["bandits"]), buffer, learned)
    except OverlayError:
        raise
    except Exception as exc:  # numpy, zipfile and json raise many types for a damaged archive
        raise OverlayError(f"{where}: unreadable ({type(exc).__name__}: {exc})") from None


def save_overlay(ov: OnlineOverlay, path: str | Path) -> Path:
    """Write ``ov`` to ``path`` atomically (the previous overlay stays whole until the rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, encode_overlay(ov))
    fsync_dir(path.parent)
    return path


def load_overlay(path: str | Path, profile: str | None = None) -> OnlineOverlay | None:
    """The overlay at ``path`` (``None`` when there is none). ``profile``: the digest it must belong
    to (:func:`profile_digest`); another profile's overlay is an :class:`OverlayError`."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise OverlayError(f"{path}: not a file")
        return None
    ov = decode_overlay(path.read_bytes(), str(path))
    if profile is not None and ov.profile != profile:
        raise OverlayError(f"{path}: belongs to another calibration of the profile (it was recalibrated); "
                           "remove it with `adaptive profile reset-online` or keep it elsewhere")
    return ov


def remove_overlay(path: str | Path) -> bool:
    """Delete the overlay at ``path`` and any temporary files a killed save left; ``True`` if one was there."""
    path = Path(path)
    for tmp in path.parent.glob(path.name + ".tmp-*"):
        tmp.unlink(missing_ok=True)
    if path.is_file():
        path.unlink()
        return True
    return False
