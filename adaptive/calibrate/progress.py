"""One progress bar for a whole calibration, with an ETA over all phases and domains.

Work is counted in *units*, roughly one full decoding step each, budgeted per phase and task
before anything runs (:func:`budgets`): a prompt's preparation costs its prefill (about
:data:`PREFILL_TOKENS_PER_STEP` prompt tokens per step) plus its continuation; a search trial
one teacher-forced forward over the domain's continuations; a raced block its tokens once for
``ar`` and once per drafter. A phase advances the bar by its budget spread over its items, and by
what is left of it when it ends early (a race that settled, a search the bound stopped), so the
bar always ends full and the ETA (from the rate so far) corrects itself as it goes.
"""

from __future__ import annotations

from collections.abc import Mapping

from adaptive.progress import progress_bar

PREFILL_TOKENS_PER_STEP = 12  # prompt tokens a prefill processes in the time of one decoding step (2-core CPU)
VERIFY_UNITS = 60  # timing a domain's verification costs (13 forward sizes, 5 repeats)
RACE_DRAFTERS = 3  # drafters a race times on average besides ar (lookup, cascade, sometimes a skip set)


def budgets(settings, prompt_tokens: Mapping[str, list[int]], tasks: list[str]) -> dict[tuple[str, str], float]:
    """Units per ``(phase, task)``: ``prepare`` per domain, ``verify``, ``search`` and ``race`` per
    task (the domains and the global set ``tasks``); ``prompt_tokens``: each domain's prompt lengths."""
    s = settings
    out: dict[tuple[str, str], float] = {("costs", ""): VERIFY_UNITS}
    for name, lengths in prompt_tokens.items():
        prefill = sum(n / PREFILL_TOKENS_PER_STEP for n in lengths)
        out[("prepare", name)] = prefill + s.continuation_tokens * len(lengths)
    blocks = min(s.race_blocks, 2 * s.min_blocks)
    for t in tasks:
        out[("verify", t)] = VERIFY_UNITS
        out[("search", t)] = s.trials * s.prompts_per_domain * s.continuation_tokens / PREFILL_TOKENS_PER_STEP
        out[("race", t)] = blocks * s.block_tokens * (1 + RACE_DRAFTERS)
    return out


class Progress:
    """The calibration's bar on stderr (lines off a terminal; nothing when ``enabled`` is false)."""

    def __init__(self, enabled: bool, budget: dict[tuple[str, str], float]):
        self.budget = dict(budget)
        self.spent: dict[tuple[str, str], float] = {}
        self.bar = None
        if enabled:  # a bar on a terminal, a line per tenth elsewhere (adaptive.progress)
            self.bar = progress_bar(max(round(sum(self.budget.values())), 1), "calibrate", unit="units",
                                    bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}] {postfix}")

    def advance(self, key: tuple[str, str], units: float, **postfix) -> None:
        """Count ``units`` of ``key``'s budget as done (never more than its budget)."""
        have = self.spent.get(key, 0.0)
        units = max(0.0, min(units, self.budget.get(key, 0.0) - have))
        self.spent[key] = have + units
        if self.bar is not None:
            self.bar.n = min(round(sum(self.spent.values())), self.bar.total)
            info = " ".join([" ".join(key).strip()] + [f"{k}={v}" for k, v in postfix.items()])
            self.bar.set_postfix_str(info, refresh=False)
            self.bar.refresh()

    def finish(self, phase: str, task: str) -> None:
        """Count what is left of ``(phase, task)``'s budget as done (it ended early, or in another process)."""
        key = (phase, task)
        self.advance(key, self.budget.get(key, 0.0))

    def phase(self, phase: str, task: str, items: int, done: int = 0) -> Phase:
        """A phase of ``items`` steps (``done`` of them finished before a resume) with its budget."""
        return Phase(self, phase, task, items, done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.n = self.bar.total
            self.bar.refresh()
            self.bar.close()


class Phase:
    """Advances its :class:`Progress` by ``budget / items`` per :meth:`update`, the rest at :meth:`close`
    (with ``progress=None``: does nothing, as in a worker process)."""

    def __init__(self, progress: Progress | None, phase: str, task: str, items: int, done: int = 0):
        self.progress, self.key = progress, (phase, task)
        self.items = max(items, 1)
        self._advance(min(done, self.items))  # named on the bar at once (its first item may take long)

    def update(self, n: int = 1, **postfix) -> None:
        if n > 0:
            self._advance(n, **postfix)

    def _advance(self, n: int, **postfix) -> None:
        """Count ``n`` items (0 too: the phase is then shown, nothing counted)."""
        if self.progress is not None:
            self.progress.advance(self.key, self.progress.budget.get(self.key, 0.0) * n / self.items, **postfix)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.finish(*self.key)
