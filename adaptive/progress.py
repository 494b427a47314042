"""Progress on stderr that suits where it goes: a redrawn bar on a terminal; on a file, a pipe or a CI
log a line per tenth of the work, with the time spent and an estimate of the time left, never
carriage-return redraws (thousands of them become one unreadable line in a log).

:func:`progress_bar` gives either, with the part of tqdm's interface the commands use (``update``,
``n``, ``total``, ``set_postfix``, ``set_postfix_str``, ``refresh``, ``close``).
:func:`quiet_library_bars` turns the bars transformers and the hub client draw (a GGUF file's
conversion, the weights' loading) off where stderr is not a terminal.

Example, on a pipe: ``progress_bar(200, "bench", unit="run")`` updated 200 times prints 10 lines,
``bench: 10% (20/200 run), 4 s, ~36 s left`` ... ``bench: 100% (200/200 run), 40 s``.
"""

from __future__ import annotations

import os
import sys
import time

STEPS = 10  # off a terminal: a line each time another tenth of the work is done


def interactive(stream=None) -> bool:
    """Whether ``stream`` (default stderr) is a terminal, where a bar may redraw itself."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _duration(seconds: float) -> str:
    """``42`` -> ``"42 s"``, ``130`` -> ``"2 min 10 s"``."""
    seconds = max(0, round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


class Lines:
    """A progress report as lines (see the module docstring): ``total`` may be unknown (``None``) until
    set; nothing is printed before it is known."""

    def __init__(self, total: int | None, desc: str, unit: str = "it", initial: int = 0, stream=None):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.stream = stream
        self.postfix = ""
        self._start = time.monotonic()
        self._begun = initial  # work done before this run (a resumed one): not in its rate
        self._closed = False
        self._shown = self._tenth()  # the tenth last printed (a resumed run's earlier ones are not printed)
        self._printed = False

    def _tenth(self) -> int:
        """Tenths of the total done (integers: no rounding drift), -1 while the total is unknown."""
        return min(self.n, self.total) * STEPS // self.total if self.total else -1

    def update(self, n: int = 1) -> None:
        self.n += n
        self._report()

    def refresh(self) -> None:
        self._report()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        if refresh:
            self._report()

    def close(self) -> None:
        """A last line for a run that ended between two printed tenths (or before its first)."""
        if not self._closed and self.total and (self._tenth() > self._shown or not self._printed) \
                and self.n > self._begun:
            self._print(final=True)
        self._closed = True

    def _report(self) -> None:
        if self._closed or not self.total:
            return
        if self._shown < 0:  # the total just became known
            self._shown = 0
        tenth = self._tenth()
        if tenth > self._shown:
            self._print(final=False)
            self._shown = tenth

    def _print(self, final: bool) -> None:
        frac = min(self.n / self.total, 1.0)
        spent = time.monotonic() - self._start
        line = f"{self.desc}: {100 * frac:3.0f}% ({self.n}/{self.total} {self.unit}), {_duration(spent)}"
        done = self.n - self._begun
        if frac < 1.0 and done > 0 and not final:
            line += f", ~{_duration(spent / done * (self.total - self.n))} left"
        if self.postfix:
            line += f" [{self.postfix}]"
        print(line, file=self.stream if self.stream is not None else sys.stderr, flush=True)
        self._printed = True


def progress_bar(total: int | None, desc: str, unit: str = "it", initial: int = 0, leave: bool = True,
                 bar_format: str | None = None, stream=None):
    """tqdm's bar on a terminal, :class:`Lines` anywhere else (``stream``: default stderr)."""
    if interactive(stream):
        from tqdm import tqdm

        kwargs = {"bar_format": bar_format} if bar_format else {}
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, leave=leave, **kwargs)
    return Lines(total, desc, unit, initial, stream)


def quiet_library_bars() -> None:
    """Off a terminal, no bars from transformers (a GGUF file's conversion, loading the weights) or the
    hub client: our own lines say what is being done."""
    if interactive():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the llama.cpp engine alone needs no transformers
        return
    hf_logging.disable_progress_bar()
