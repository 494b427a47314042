"""The prefix cache: finished requests' keys and values, kept so that a later request sharing their
first tokens starts from them instead of prefilling them again.

Terms:

- an **entry** is one finished sequence: its token ids (prompt and the tokens generated whose keys
  are in the cache, after the chat template: matching is by ids, so a system prompt or a document
  shared by different users' requests is reused too) and the backbone's copy of their keys and values
  (its ``handle``, given back by ``handle.release()``);
- a request's **cached tokens** are the longest common prefix of its prompt and one entry's ids,
  less its last prompt token (the prefill must compute at least one position: its logits give the
  first new token).

Example: an entry ``[5, 6, 7, 8]`` and a prompt ``[5, 6, 9]`` share 2 tokens; a prompt ``[5, 6]``
shares 1 (its last token is prefilled), and ``[5, 6, 7, 8, 1, 2]`` shares 4.

:class:`PrefixStore` is the bookkeeping, the same on every engine: entries by least recent use
within a byte budget, the longest match, and the counts ``/metrics`` shows. The backbones hold the
keys and values (``keep_prefix`` and ``restore_prefix``): the torch backbone copies them out of a
finished cache and into a new one; llama.cpp keeps the finished sequence's cells and shares them
with the new sequence. What a request decodes from a cached prefix is what it decodes from scratch:
the keys at a position depend only on the tokens up to it (in fp32 token for token; in bf16 and
quantized kernels the rows' rounding may part at near-ties, as any batched forward's).

An entry lives in the backbone whose forwards computed it, so it never outlives the weights; a
routing profile does not change keys and values (the feature rows an eagle head reads are restored
only into a cache keeping the same layers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from adaptive.engine.audit import common_prefix
from adaptive.errors import ConfigError

DEFAULT_PREFIX_CACHE_MIB = 256  # the byte budget of each engine's prefix cache, in MiB (0: no cache)


@dataclass(eq=False)
class Entry:
    """One kept sequence: ``ids`` (``tokens`` of them have keys kept), its backbone's ``handle``,
    its size in ``nbytes`` and, while a request copies from it, ``pins`` > 0 (not evicted)."""

    ids: tuple[int, ...]
    handle: object
    nbytes: int
    pins: int = 0
    uses: int = 0

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Match:
    """A lookup's answer: the ``entry`` to start from (``None``: none) and the prompt's ``tokens``
    it holds (0 when none)."""

    entry: Entry | None
    tokens: int


@dataclass
class PrefixStats:
    """What ``/metrics`` shows of a prefix cache."""

    entries: int = 0
    tokens: int = 0
    nbytes: int = 0
    budget: int = 0
    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled because they were cached
    evictions: int = 0

    def to_dict(self) -> dict:
        return {"entries": self.entries, "tokens": self.tokens, "bytes": self.nbytes, "budget_bytes": self.budget,
                "lookups": self.lookups, "hits": self.hits, "cached_tokens": self.cached_tokens,
                "evictions": self.evictions}


@dataclass(eq=False)
class PrefixStore:
    """Entries within ``budget`` bytes (0: keep nothing), least recently used evicted first. Thread-safe."""

    budget: int
    _entries: list[Entry] = field(default_factory=list)  # least recently used first
    _stats: PrefixStats = field(default_factory=PrefixStats)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self):
        if self.budget < 0:
            raise ConfigError(f"the prefix cache's budget must be >= 0 bytes, got {self.budget}")
        self._stats.budget = self.budget

    def __getstate__(self) -> dict:
        """Pickled (a model sent to a calibration worker process) with its budget and no entries: they are
        this process's tensors and this context's cells."""
        return {"budget": self.budget}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["budget"])

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def stats(self) -> PrefixStats:
        with self._lock:
            s = self._stats
            return PrefixStats(len(self._entries), sum(e.tokens for e in self._entries),
                               sum(e.nbytes for e in self._entries), s.budget, s.lookups, s.hits,
                               s.cached_tokens, s.evictions)

    def peek(self, prompt_ids: Sequence[int]) -> int:
        """The prompt's cached tokens now, touching nothing (the engine choice's estimate)."""
        with self._lock:
            return self._best(prompt_ids).tokens

    def _best(self, prompt_ids: Sequence[int]) -> Match:
        best, most = None, 0
        limit = len(prompt_ids) - 1  # the last prompt token is always prefilled
        for e in self._entries:
            n = min(common_prefix(e.ids, prompt_ids), limit)
            if n > most:
                best, most = e, n
        return Match(best, most)

    def lookup(self, prompt_ids: Sequence[int]) -> Match:
        """The entry holding the most of the prompt, pinned (not evicted) until :meth:`unpin`; counted
        as a lookup (and a hit with its tokens, which the caller reports once restored: :meth:`restored`)."""
        with self._lock:
            self._stats.lookups += 1
            m = self._best(prompt_ids)
            if m.entry is not None:
                m.entry.pins += 1
                self._touch(m.entry)
            return m

    def restored(self, tokens: int) -> None:
        """A request started from ``tokens`` cached tokens."""
        if tokens > 0:
            with self._lock:
                self._stats.hits += 1
                self._stats.cached_tokens += tokens

    def unpin(self, entry: Entry | None) -> None:
        if entry is not None:
            with self._lock:
                entry.pins -= 1
                self._trim()

    def add(self, ids: Sequence[int], handle, nbytes: int) -> bool:
        """Keep ``handle`` (the keys of ``ids``), evicting the least recently used entries to stay
        within the budget; an entry whose ids start the new ones is replaced by it (a conversation's
        next turn holds the last one's). ``False`` (and ``handle`` released) when it is not kept: no
        budget, larger than the budget, or already held by a longer entry."""
        ids = tuple(ids)
        with self._lock:
            if not self.enabled or nbytes > self.budget or not ids or any(
                    common_prefix(e.ids, ids) == len(ids) for e in self._entries):
                handle.release()
                return False
            for e in [e for e in self._entries if e.pins == 0 and common_prefix(e.ids, ids) == e.tokens]:
                self._drop(e)
            self._entries.append(Entry(ids, handle, nbytes))
            self._trim()
            return True

    def resize(self, budget: int) -> None:
        """A new budget (0: off, every entry released), least recently used entries evicted to fit it."""
        if budget < 0:
            raise ConfigError(f"the prefix cache's budget must be >= 0 bytes, got {budget}")
        with self._lock:
            self.budget = self._stats.budget = budget
            self._trim()

    def evict_one(self) -> bool:
        """Evict the least recently used unpinned entry (a backbone that needs its room); ``False``: none."""
        with self._lock:
            for e in self._entries:
                if e.pins == 0:
                    self._drop(e)
                    self._stats.evictions += 1
                    return True
            return False

    def evict_stale(self, stale: Callable[[object], bool]) -> int:
        """Evict every unpinned entry whose handle ``stale(handle)`` says has outlived its use (a backbone's
        own rule: llama.cpp's kept cells slow every decode); the number evicted."""
        with self._lock:
            old = [e for e in self._entries if e.pins == 0 and stale(e.handle)]
            for e in old:
                self._drop(e)
            self._stats.evictions += len(old)
            return len(old)

    def clear(self) -> None:
        with self._lock:
            for e in [e for e in self._entries if e.pins == 0]:
                self._drop(e)

    def _touch(self, entry: Entry) -> None:
        entry.uses += 1
        self._entries.remove(entry)
        self._entries.append(entry)

    def _trim(self) -> None:
        while sum(e.nbytes for e in self._entries) > self.budget and self.evict_one():
            pass

    def _drop(self, entry: Entry) -> None:
        self._entries.remove(entry)
        entry.handle.release()


def budget_bytes(mib: float) -> int:
    """A budget in MiB as bytes; :class:`ConfigError` below 0."""
    if mib < 0:
        raise ConfigError(f"the prefix cache's budget must be >= 0 MiB, got {mib}")
    return int(mib * 2**20)


@dataclass(eq=False)
class KeptRows:
    """The torch backbone's entry handle: a finished :class:`~adaptive.engine.backbone.KVCache`'s first
    positions copied out (``k``, ``v``: ``[n_layers, n_kv_heads, tokens, head_dim]``; ``features``:
    ``[tokens, len(feature_layers), hidden]`` or ``None``), so that its slot or tensors go on to be reused."""

    k: object
    v: object
    features: object = None
    feature_layers: tuple[int, ...] = ()

    @classmethod
    def of(cls, cache, n: int) -> KeptRows:
        """The first ``n`` positions of ``cache``."""
        rows = cache.features[:n].clone() if cache.features is not None else None
        return cls(cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone(), rows, tuple(cache.feature_layers))

    @property
    def nbytes(self) -> int:
        tensors = [self.k, self.v] + ([self.features] if self.features is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def restore(self, cache, n: int) -> int:
        """Write the first ``n`` kept positions into ``cache``: ``n``, or 0 where the cache keeps other
        feature rows than these (its forwards would lack them)."""
        if tuple(cache.feature_layers) != self.feature_layers or cache.k.shape[:2] != self.k.shape[:2]:
            return 0
        cache.k[:, :, :n].copy_(self.k[:, :, :n])
        cache.v[:, :, :n].copy_(self.v[:, :, :n])
        if self.features is not None:
            cache.features[:n].copy_(self.features[:n])
        return n

    def release(self) -> None:
        self.k = self.v = self.features = None
