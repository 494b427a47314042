"""Work directories of resumable jobs (calibration, distillation): a lock, atomic checkpoints, resume.

A job that may be killed keeps its checkpoints in one directory (``OUT.work/``). This module is
all that calibration and distillation share about it:

* :class:`WorkDir`: the ``flock`` lock (one live job per directory), :meth:`WorkDir.begin` (a
  leftover directory without ``resume`` is refused; a resume with other settings is refused
  naming what differs), :meth:`WorkDir.guarded` (removed after success, kept after a failure);
* :func:`atomic_write`, :func:`write_json`: a file is its old content or its new, never torn;
* :func:`append_json_line`, :func:`read_json_lines`: a log of records, each fsynced, a torn
  last line dropped on reading;
* :func:`checkpointed`: load a checkpoint if it is there, else compute and write it.

Beside them, what is kept per machine: :func:`cache_dir`, and :func:`cpu_name` to label it.

It imports only the standard library and :mod:`adaptive.errors` (a bottom-layer module).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from adaptive.errors import AdaptiveError

# Bumped when what a work directory holds changes shape: a leftover of another format is then
# refused by the state comparison ("made with different format") instead of being misread.
CHECKPOINT_FORMAT = 2

T = TypeVar("T")


def cache_dir() -> Path:
    """What adaptive builds once and keeps (converted models and tokenizers, joined GGUF files,
    llama.cpp builds and what was probed of them): ``$ADAPTIVE_CACHE``, else ``~/.cache/adaptive``."""
    return Path(os.environ.get("ADAPTIVE_CACHE", Path.home() / ".cache" / "adaptive"))


def cpu_name() -> str:
    """The CPU's model as ``/proc/cpuinfo`` names it (``"Intel(R) Xeon(R) Processor"``), else as
    :mod:`platform` does: what a measurement, or an answer kept about this machine, is labelled with."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def slug(name: str) -> str:
    """A file-name-safe, collision-free form of a name: ``"a b"`` -> ``"a_b-<8 hex>"``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40] + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary sibling, fsync it and rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that a rename into it survives a crash (a no-op where that is refused)."""
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


def write_json(path: Path, obj) -> None:
    """:func:`atomic_write` of ``obj`` as indented JSON."""
    atomic_write(path, (json.dumps(obj, indent=1) + "\n").encode())


def read_json(path: Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def append_json_line(path: Path, rec: dict) -> None:
    """Append ``rec`` as one JSON line and fsync it (a kill loses at most this line)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json_lines(path: Path, accept: Callable[[int, Any], bool] = lambda i, rec: True) -> list:
    """The complete records of a :func:`append_json_line` log, in order, up to the first line that
    is torn (killed mid-write) or that ``accept(index, record)`` refuses; the file is rewritten
    to exactly those records, so appending continues after them. A missing file: ``[]``.

    Example: lines ``{"trial": 0}``, ``{"trial": 1}``, ``{"tri`` with
    ``accept=lambda i, r: r.get("trial") == i`` -> the first two.
    """
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if not accept(len(out), rec):
            break
        out.append(rec)
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in out).encode())
    return out


def checkpointed(path: Path, compute: Callable[[], T], load: Callable[[Path], T] = read_json,
                 save: Callable[[Path, T], None] = write_json) -> T:
    """``load(path)`` when the checkpoint exists, else ``compute()``, saved with ``save(path, value)``.

    A checkpoint that cannot be loaded (a file from an interrupted older writer) is computed again.
    """
    path = Path(path)
    if path.exists():
        try:
            return load(path)
        except Exception:  # unreadable: redo it
            path.unlink(missing_ok=True)
    value = compute()
    save(path, value)
    return value


def _normalised(state: dict) -> dict:
    return json.loads(json.dumps(state))  # as read back from state.json: a resumed run compares equal


class WorkDir:
    """A job's checkpoint directory ``path``, guarded by a lock file.

    ``what`` names the job in messages ("calibration"); errors are raised as ``error`` (an
    :class:`AdaptiveError` subclass); ``busy_hint`` ends the message when another job holds the lock.
    """

    STATE = "state.json"

    def __init__(self, path: Path, what: str, error: type[AdaptiveError] = AdaptiveError, busy_hint: str = ""):
        self.path = Path(path)
        self.what = what
        self.error = error
        self.busy_hint = busy_hint
        self._fd: int | None = None

    def file(self, kind: str, name: str | None = None, ext: str = "json") -> Path:
        """``KIND.EXT``, or ``KIND-<slug(name)>.EXT`` for one of several names."""
        return self.path / (f"{kind}-{slug(name)}.{ext}" if name is not None else f"{kind}.{ext}")

    def acquire(self) -> None:
        """Take the lock, or raise ``error`` if another live job holds it.

        The lock is an ``flock`` on ``path/lock``, held for as long as this process keeps the file
        open: the operating system releases it when the process ends, however it ends (a SIGKILL
        included), so there is no stale lock to take over and no race in taking one over. The file
        records who holds it, for the message.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / "lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise self.error(f"another {self.what} ({holder}) is writing {self.path}; wait for it"
                             + self.busy_hint) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the flock; the file may stay (the next holder truncates it)

    def remove(self) -> None:
        self.release()
        shutil.rmtree(self.path, ignore_errors=True)

    def begin(self, state: dict, resume: bool, rerun_hint: str) -> bool:
        """Lock the directory and resume or refuse; ``True`` when resuming a checkpoint.

        ``state`` (JSON-able) is what decides the job's result. A directory left by an interrupted
        job is refused unless ``resume``; resuming one made with another state is refused, naming
        the keys that differ and ending with ``rerun_hint``. A fresh directory records ``state``.
        The lock is taken first: a live job is reported as such, not as a leftover.
        """
        state_path = self.path / self.STATE
        had_work = self.path.exists()
        self.acquire()
        try:
            if not state_path.exists():
                write_json(state_path, state)
                return False
            if had_work and not resume:
                raise self.error(f"an interrupted {self.what} left {self.path}: pass --resume to continue it, "
                                 "or delete it to start over")
            old, new = read_json(state_path), _normalised(state)
            if old != new:
                diff = [k for k in new if not isinstance(old, dict) or old.get(k) != new[k]]
                raise self.error(f"--resume: the checkpoint in {self.path} was made with different "
                                 f"{', '.join(diff)}; {rerun_hint}")
            return True
        except BaseException:
            self.release()
            raise

    @contextmanager
    def guarded(self, state: dict, resume: bool, rerun_hint: str) -> Iterator[bool]:
        """:meth:`begin`, then the job; the directory is removed after success, unlocked and kept
        (for ``resume``) after any failure. Yields whether it resumed."""
        resumed = self.begin(state, resume, rerun_hint)
        try:
            yield resumed
        except BaseException:
            self.release()
            raise
        self.remove()
