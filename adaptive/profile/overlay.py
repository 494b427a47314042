"""The online overlay: what a runtime learned from the traffic it served, saved beside its profile.

A calibrated profile is never edited in place. What the runtime learns while serving (issue 20:
:mod:`adaptive.runtime.online`) is kept in one file next to it, ``PROFILE.online`` by default::

    {"format": "adaptive-online", "version": 1, "bytes": N, "sha256": "..."}\\n   one JSON header line
    <N bytes: a NumPy .npz archive>                                                the state

The archive holds ``meta`` (UTF-8 JSON: the profile it belongs to, the save's generation and
time, the bandits' posteriors, the learned domains' records, the buffer's token ids) and the arrays:
each table's bigram counts (``counts/I/prev``, ``succ``, ``count``), the out-of-domain buffer's
embeddings (``buffer/vectors``) and each learned domain's anchors (``learned/I/anchors``).

**Replicas** (issue 45). Several servers over one profile each write only their own overlay,
``PROFILE.online.d/REPLICA.online`` (:func:`replica_path`; ``REPLICA`` is ``--replica-id``, by default
host and pid), holding only what *that* replica observed: its requests, its pair counts, the evidence
its bandits gathered beyond their prior, its buffered requests (each with an id) and the domains it
measured (with their members' ids). Every replica reads the others' files and merges
(:func:`merge_overlays`): a sum over replicas of contributions each kept under its replica's id,
as a G-counter, so merging is order-free and merging a file twice changes nothing. The single
``PROFILE.online`` file of earlier versions is read as one more replica's contribution (its
``replica`` field, or ``legacy``) and never written again.

Writes are atomic (a temporary sibling, fsynced, renamed over the file, the directory fsynced):
a process killed while saving leaves the previous complete overlay, never a torn one. The header's
checksum catches a file damaged afterwards; a damaged, foreign or newer overlay is an
:class:`OverlayError` naming the file, and the profile itself is never touched by any of this.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
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


LEGACY_REPLICA = "legacy"  # the replica a single-file overlay of earlier versions is read as
_REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class OverlayError(AdaptiveError, ValueError):
    """An online overlay is truncated, corrupt, of another format or version, or of another profile."""


def overlay_path(profile_dir: str | Path) -> Path:
    """Where a profile's overlay lives by default: ``PROFILE.online`` beside the directory."""
    p = Path(profile_dir)
    return p.with_name(p.name + SUFFIX)


def replica_dir(path: str | Path) -> Path:
    """The directory of the replicas' overlays for the overlay ``path``: ``PROFILE.online.d``."""
    p = Path(path)
    return p.with_name(p.name + ".d")


def check_replica_id(replica: str) -> str:
    """``replica`` if it can name a file (letters, digits, ``.``, ``_``, ``-``; 1-64 characters, not
    starting with a punctuation mark), else a ``ValueError`` saying so."""
    if not isinstance(replica, str) or not _REPLICA_ID.match(replica):
        raise ValueError(f"replica id {replica!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
                         "letter or digit")
    return replica


def default_replica_id() -> str:
    """``HOST-PID``, made a valid replica id: a server's own unless ``--replica-id`` names one."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:40].strip(".-_") or "host"
    return f"{host}-{os.getpid()}"


def replica_path(path: str | Path, replica: str) -> Path:
    """Where replica ``replica`` of the overlay ``path`` writes: ``PROFILE.online.d/REPLICA.online``."""
    return replica_dir(path) / f"{check_replica_id(replica)}{SUFFIX}"


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
    id: str = ""  # "REPLICA:N": unique over the replicas (a learned domain names its members by it)


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
    member_ids: tuple[str, ...] = ()  # the buffered requests (of any replica) that formed it


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
    replica: str = ""  # who wrote it (its contribution alone); "" in a merged view

    def summary(self) -> dict:
        """What ``adaptive profile show`` prints: sizes and the learned domains' decisions."""
        return {"replica": self.replica, "generation": self.generation, "saved": self.saved, "requests": self.requests,
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
                        "record": to_json(d.record), "member_ids": list(d.member_ids)})
    meta = {"profile": ov.profile, "generation": ov.generation, "saved": ov.saved, "requests": ov.requests,
            "tables": tables, "bandits": ov.bandits, "learned": learned, "replica": ov.replica,
            "buffer": [{"prompt": list(b.prompt), "output": list(b.output), "id": b.id} for b in ov.buffer]}
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
            replica = str(meta.get("replica") or "")
            buffer = tuple(BufferedRequest(vectors[i].copy(), tuple(int(t) for t in e["prompt"]),
                                           tuple(int(t) for t in e["output"]),
                                           str(e.get("id") or f"{replica or LEGACY_REPLICA}:{i}"))
                           for i, e in enumerate(entries))
            learned = tuple(LearnedDomain(d["name"], z[f"learned/{i}/anchors"].copy(),
                                          from_json(DomainRecord, d["record"], f"learned domain {d['name']}"),
                                          int(d["members"]), d.get("created", ""),
                                          tuple(str(m) for m in d.get("member_ids", ())))
                            for i, d in enumerate(meta["learned"]))
            return OnlineOverlay(str(meta["profile"]), int(meta["generation"]), str(meta.get("saved", "")),
                                 int(meta.get("requests", 0)), counts, dict(meta["bandits"]), buffer, learned,
                                 replica)
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
    """Delete the overlay at ``path``, every replica's (``PROFILE.online.d``) and any temporary files a
    killed save left; ``True`` if any overlay was there."""
    path = Path(path)
    found = False
    folder = replica_dir(path)
    files = [path] + (sorted(folder.iterdir()) if folder.is_dir() else [])
    for f in files:
        for tmp in f.parent.glob(f.name + ".tmp-*"):
            tmp.unlink(missing_ok=True)
        if f.is_file():
            found = found or f.name.endswith(SUFFIX)
            f.unlink()
    try:
        folder.rmdir()
    except OSError:  # none there, or a server still running wrote again meanwhile: its file stays
        pass
    return found


def load_replicas(path: str | Path, profile: str | None = None, skip: str | None = None,
                  on_error=None, cache: dict | None = None) -> dict[str, OnlineOverlay]:
    """Every replica's overlay for the overlay ``path`` (``{replica: overlay}``): the files of
    ``PROFILE.online.d`` and the single file of earlier versions (as its ``replica``, else
    ``legacy``), but not ``skip``'s. Files of another calibration (``profile``: the digest) are left
    out. A damaged file is an :class:`OverlayError`, or, with ``on_error``, reported to it
    (``on_error(path, error)``) and left out: one replica's bad file must not stop the others.
    ``cache`` (a dict kept by the caller between calls): a file whose size and modification time are
    those of its last read is not read again (nor, if damaged, reported again)."""
    path = Path(path)
    folder = replica_dir(path)
    files = [path] + (sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else [])
    out: dict[str, OnlineOverlay] = {}
    for f in files:
        replica = f.name[: -len(SUFFIX)] if f.parent == folder else None
        if skip is not None and replica == skip:
            continue
        if cache is None:
            ov = _read_replica(f, profile, on_error)
        else:
            try:
                st = f.stat()
            except OSError:
                continue
            hit = cache.get(str(f))
            if hit is None or hit[0] != (st.st_mtime_ns, st.st_size):
                hit = cache[str(f)] = ((st.st_mtime_ns, st.st_size), _read_replica(f, profile, on_error))
            ov = hit[1]
        if ov is None:
            continue
        name = replica or ov.replica or LEGACY_REPLICA
        if name != skip:
            out[name] = ov
    return out


def _read_replica(f: Path, profile: str | None, on_error) -> OnlineOverlay | None:
    """One replica's overlay for :func:`load_replicas`: ``None`` when absent, damaged (reported to
    ``on_error``, else raised) or of another calibration (reported)."""
    try:
        ov = load_overlay(f)
    except OverlayError as exc:
        if on_error is None:
            raise
        on_error(f, exc)
        return None
    if ov is not None and profile is not None and ov.profile != profile:
        if on_error is not None:
            on_error(f, OverlayError(f"{f}: belongs to another calibration of the profile; left out"))
        return None
    return ov


def add_pair_counts(parts: list[PairCounts]) -> PairCounts:
    """The sum of pair counts (each pair's counts added): ``add_pair_counts([a, b])`` has every pair of
    ``a`` and ``b``, a pair in both with the sum of its counts; sorted by ``(prev, succ)``."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return PairCounts(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    prev = np.concatenate([p.prev for p in parts])
    succ = np.concatenate([p.succ for p in parts])
    count = np.concatenate([p.count for p in parts]).astype(np.float64)
    keys, inverse = np.unique(np.stack([prev, succ], axis=1), axis=0, return_inverse=True)
    total = np.zeros(len(keys), np.float64)
    np.add.at(total, inverse.reshape(-1), count)
    return PairCounts(keys[:, 0], keys[:, 1], total.astype(np.float32))


def merge_overlays(replicas: dict[str, OnlineOverlay]) -> OnlineOverlay:
    """One view of several replicas' overlays (``replica`` ``""``): requests and each table's pair counts
    summed, the buffers pooled (less the requests some learned domain took as members), the learned
    domains of all of them in the order they were made (a name made twice keeps its first making;
    nearness of anchors is the runtime's to judge, :class:`~adaptive.runtime.online.OnlineLearner`),
    and each bandit's saved states in a list by replica (``{"kind": "replicas", "states": [...]}``; a live
    bandit's ``rebase`` adds their evidence up). Order-free: the result depends only on the set of
    replicas' files."""
    names = sorted(replicas)
    counts: dict[str, list[PairCounts]] = {}
    for r in names:
        for table, c in replicas[r].counts.items():
            counts.setdefault(table, []).append(c)
    learned: dict[str, LearnedDomain] = {}
    for d in sorted((d for r in names for d in replicas[r].learned), key=lambda d: (d.created, d.name)):
        learned.setdefault(d.name, d)
    taken = {m for d in learned.values() for m in d.member_ids}
    buffer = tuple(b for r in names for b in replicas[r].buffer if b.id not in taken)
    bandits: dict[str, dict] = {}
    for r in names:
        for key, state in replicas[r].bandits.items():
            bandits.setdefault(key, {"kind": "replicas", "states": []})["states"].append(state)
    profile = replicas[names[0]].profile if names else ""
    return OnlineOverlay(profile, max((replicas[r].generation for r in names), default=0),
                         max((replicas[r].saved for r in names), default=""),
                         sum(replicas[r].requests for r in names),
                         {t: add_pair_counts(c) for t, c in sorted(counts.items())}, bandits, buffer,
                         tuple(learned.values()))
