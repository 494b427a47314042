""":func:`adaptive.workdir.cpu_name`: the label of this machine's measurements and kept answers."""

from __future__ import annotations

import builtins
import io
import platform

from adaptive import workdir


def test_the_cpu_is_named_as_proc_cpuinfo_names_it(monkeypatch):
    cpuinfo = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t: fpu\n"
    real = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: io.StringIO(cpuinfo) if f == "/proc/cpuinfo"
                        else real(f, *a, **k))
    assert workdir.cpu_name() == "Intel(R) Xeon(R) Processor"


def test_without_proc_cpuinfo_the_platform_names_it(monkeypatch):
    def missing(f, *a, **k):
        raise FileNotFoundError(f)

    monkeypatch.setattr(builtins, "open", missing)
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert workdir.cpu_name() == "x86_64"
