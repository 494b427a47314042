"""Dropping a mapped file's resident pages (:func:`adaptive.engine.llamacpp.release_mapped_file`), which
the llama.cpp engine does after loading a GGUF file: the mechanism on plain files, without llama.cpp."""

from __future__ import annotations

import mmap
import random
from pathlib import Path

import pytest

from adaptive.engine.llamacpp_host import mapped_resident, release_mapped_file

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")


def test_a_read_only_shared_mapping_s_pages_are_dropped_and_read_back_the_same(tmp_path):
    data = random.Random(0).randbytes(2 << 20)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    assert view[:] == data  # every page read
    assert mapped_resident(path) >= len(data) // 2
    assert release_mapped_file(path) == len(data)
    assert mapped_resident(path) == 0
    assert view[:] == data  # read again from the file
    view.close()
    assert release_mapped_file(path) == 0 and mapped_resident(path) == 0  # no mapping left


def test_a_writable_private_mapping_is_never_dropped(tmp_path):
    """Dropping a private page would lose what was written to it: only read-only shared maps qualify."""
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(65536))
    with open(path, "r+b") as f:
        view = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view[0] = 7
    assert release_mapped_file(path) == 0
    assert view[0] == 7
    view.close()


def test_a_file_under_a_name_that_is_not_utf8_is_found(tmp_path):
    """/proc/self/maps holds names as bytes: one that is not UTF-8 is compared as its path decodes."""
    path = tmp_path / Path(bytes([0x77, 0xff, 0x2e, 0x62]).decode("utf-8", "surrogateescape"))
    try:
        path.write_bytes(bytes(65536))
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes no such name")
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    assert view[:] == bytes(65536)
    assert mapped_resident(path) > 0
    assert release_mapped_file(path) == 65536 and mapped_resident(path) == 0
    view.close()
