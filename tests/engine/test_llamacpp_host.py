"""The llama.cpp engine's host side (:mod:`adaptive.engine.llamacpp_host`): whether llama.cpp's extra
weight layouts (AMX, repacked) may run on this machine, probed once in a child process and kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from adaptive.engine import llamacpp_host  # noqa: E402

AMX_INFO = "CPU : AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 | "


class _Children:
    """A stand-in for ``subprocess.run``: each probe child's exit code and output, and how many ran."""

    def __init__(self, returncode: int, stdout: str = ""):
        self.returncode, self.stdout, self.runs = returncode, stdout, 0

    def __call__(self, cmd, **kwargs):
        import subprocess

        self.runs += 1
        assert kwargs["env"]["ADAPTIVE_LLAMACPP_EXTRA_BUFFERS"] == "1"  # the child decodes with them on
        return subprocess.CompletedProcess(cmd, self.returncode, self.stdout, "ggml: some error")


@pytest.fixture
def amx_build(monkeypatch, tmp_path):
    """A build with AMX kernels, a private cache, nothing said yet, no forced answer."""
    monkeypatch.setattr(llamacpp_host, "system_info", lambda: AMX_INFO)
    monkeypatch.setenv("ADAPTIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ADAPTIVE_LLAMACPP_EXTRA_BUFFERS", raising=False)
    monkeypatch.setattr(llamacpp_host, "_WARNED", set())
    return tmp_path


def test_without_amx_kernels_nothing_is_probed(monkeypatch, tmp_path):
    monkeypatch.setattr(llamacpp_host, "system_info", lambda: "CPU : AVX2 = 1 | FMA = 1 | REPACK = 1 | ")
    monkeypatch.delenv("ADAPTIVE_LLAMACPP_EXTRA_BUFFERS", raising=False)
    child = _Children(-11)
    monkeypatch.setattr("subprocess.run", child)
    assert llamacpp_host.extra_buffers_ok(tmp_path / "m.gguf") is True and child.runs == 0


def test_a_probe_killed_by_a_fault_turns_extra_buffers_off_and_is_kept(amx_build, monkeypatch, capsys):
    gguf = amx_build / "m.gguf"
    gguf.write_bytes(b"GGUF")
    child = _Children(-11)  # SIGSEGV: llama.cpp's AMX product faulted
    monkeypatch.setattr("subprocess.run", child)
    assert llamacpp_host.extra_buffers_ok(gguf) is False
    assert "llama.cpp's AMX kernels fault on this machine" in capsys.readouterr().err
    assert llamacpp_host.extra_buffers_ok(gguf) is False and child.runs == 1  # the kept answer, not a second probe
    kept = json.loads((amx_build / "cache" / "llama.cpp" / "extra-buffers.json").read_text())
    assert list(kept.values()) == [False] and str(gguf.resolve()) in next(iter(kept))  # not a GGUF: by path
    other = amx_build / "other.gguf"
    other.write_bytes(b"GGUF....")
    assert llamacpp_host.extra_buffers_ok(other) is False and child.runs == 2  # another file: probed on its own


def test_files_of_one_weight_type_share_one_answer(amx_build, monkeypatch, tiny_gguf):
    path, _ = tiny_gguf
    copy = amx_build / "copy.gguf"
    copy.write_bytes(Path(path).read_bytes())
    child = _Children(0, "ok")
    monkeypatch.setattr("subprocess.run", child)
    assert llamacpp_host.extra_buffers_ok(path) is True and llamacpp_host.extra_buffers_ok(copy) is True
    assert child.runs == 1
    kept = json.loads((amx_build / "cache" / "llama.cpp" / "extra-buffers.json").read_text())
    assert [k.rsplit("|", 1)[1] for k in kept] == ["file type 0"]  # the tiny file's F32 weights


def test_a_probe_that_decodes_keeps_extra_buffers_on(amx_build, monkeypatch):
    gguf = amx_build / "m.gguf"
    gguf.write_bytes(b"GGUF")
    child = _Children(0, "loaded\nok\n")
    monkeypatch.setattr("subprocess.run", child)
    assert llamacpp_host.extra_buffers_ok(gguf) is True and llamacpp_host.extra_buffers_ok(gguf) is True
    assert child.runs == 1


@pytest.mark.parametrize("returncode", [1, -9])  # an error, an out-of-memory kill: not the kernels' answer
def test_a_probe_that_fails_otherwise_answers_no_for_this_process_only(amx_build, monkeypatch, capsys, returncode):
    gguf = amx_build / "m.gguf"
    gguf.write_bytes(b"GGUF")
    child = _Children(returncode)
    monkeypatch.setattr("subprocess.run", child)
    assert llamacpp_host.extra_buffers_ok(gguf) is False
    err = capsys.readouterr().err
    assert f"failed (exit {returncode}): ggml: some error" in err and "kernels fault" not in err
    assert llamacpp_host.extra_buffers_ok(gguf) is False and child.runs == 2  # nothing kept: probed again


def test_a_forced_answer_is_not_probed(amx_build, monkeypatch):
    monkeypatch.setattr("subprocess.run", _Children(-11))
    for forced, expected in (("0", False), ("1", True)):
        monkeypatch.setenv("ADAPTIVE_LLAMACPP_EXTRA_BUFFERS", forced)
        assert llamacpp_host.extra_buffers_ok(amx_build / "absent.gguf") is expected


def test_the_probe_child_decodes_a_real_file(tiny_gguf, amx_build):
    path, _ = tiny_gguf
    assert llamacpp_host.extra_buffers_ok(path) is True  # a real child process decoded it with the extra buffers on
    kept = json.loads((amx_build / "cache" / "llama.cpp" / "extra-buffers.json").read_text())
    assert list(kept.values()) == [True]
