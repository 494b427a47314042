"""What the process gives back to the system once work is done: the C heap's free pages and the
OpenMP threads a thread's parallel work started. Each is a no-op where the library it calls is not
there (not glibc, not libgomp)."""

from __future__ import annotations

import ctypes


def release_heap() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``); whether it could.
    Loading a model and packing its weights free hundreds of MB of temporaries that glibc otherwise
    keeps in the process's resident set: ~200 MB of the embedded model's two-engine runtime (1.27 GB
    before, 1.08 GB after). A no-op without glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def release_threads() -> bool:
    """Give back the OpenMP threads the calling thread's parallel work started (libgomp's
    ``omp_pause_resource_all``, soft: the next parallel region of this thread starts them again);
    whether it could (``False`` where OpenMP is not libgomp, or this thread is inside a parallel region).

    Call it on a thread that loaded a model and hands decoding to another (a server: the CLI's main
    thread loads, the scheduler's worker decodes). torch and llama.cpp's ggml share one libgomp in
    the process, and libgomp keeps a pool of threads per thread that started a parallel region. With
    the loading thread's pool kept beside the decoding thread's, libgomp manages more threads than
    the machine has CPUs and throttles their spinning: ggml's barriers between a decode's operations
    then sleep and wake on futexes. On the 2-core EPYC a llama.cpp step of the embedded model took
    15.2 ms from a second thread against 12.2 ms from the loading one, and 11.3 ms from the second
    thread once the loading thread's pool was given back (``docs/design.md``, "One OpenMP pool")."""
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # 1: omp_pause_soft
