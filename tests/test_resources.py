"""What the process gives back to the system (adaptive/resources.py)."""

import pytest


def test_release_heap_gives_freed_pages_back():
    """After freeing many small allocations (as loading and packing do), the resident set shrinks."""
    import sys

    from adaptive.resources import release_heap

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim")

    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    release_heap()
    chunks = [bytearray(64 * 1024 - 64) for _ in range(3000)]  # ~190 MB below mmap's threshold: heap pages
    chunks[-1][0] = 1
    high = rss_mb()
    del chunks[:-1]  # the last one pins the heap's top: only a trim returns the pages below it
    kept = rss_mb()
    assert release_heap() is True
    assert rss_mb() < kept - 100 and kept > high - 50


def test_release_threads_gives_back_the_calling_threads_openmp_pool():
    """A thread whose torch work started OpenMP threads gives them back (the process has that many
    threads fewer), and its next parallel region starts them again. Run in a child process: the
    test process's own pools are the tests' business."""
    import os
    import subprocess
    import sys
    import textwrap

    import torch

    if "OpenMP" not in torch.__config__.parallel_info() or (os.cpu_count() or 1) < 2:
        pytest.skip("torch runs without OpenMP threads here")
    code = textwrap.dedent("""
        import os, torch
        from adaptive.resources import release_threads
        torch.set_num_threads(2)
        count = lambda: len(os.listdir("/proc/self/task"))
        base = count()
        x = torch.randn(512, 512)
        (x @ x).sum().item()  # a parallel region on this thread: its pool starts
        started = count()
        released = release_threads()
        after = count()
        (x @ x).sum().item()
        print(base, started, released, after, count())
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # whatever an earlier test left in the environment
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env)
    base, started, released, after, again = out.stdout.split()
    assert released == "True"
    assert int(started) > int(base) and int(after) == int(base) and int(again) == int(started)
