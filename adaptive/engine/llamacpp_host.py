"""The host side of the llama.cpp engine: loading llama-cpp-python and its shared libraries, and
probing what this machine's build can run, so that :mod:`adaptive.engine.llamacpp` (the backbone)
holds decoding alone. With it, the only modules that touch llama-cpp-python.

* :func:`library`, :func:`init_backend`: the binding, imported when first needed, and llama.cpp's
  backend started once with its own logging silenced.
* :func:`threadpool_api`, :func:`layer_input_api`: calls llama-cpp-python does not bind, found in
  the shared libraries it ships (ggml's thread pool; llama.cpp's C++ layer-input API, by its
  mangled name).
* :func:`extra_buffers_ok`: whether llama.cpp's AMX and repacked weight layouts may be used here,
  probed once per machine, version and weight type in a child process (a CPU can report AMX while
  its tiles fault) and kept in ``$ADAPTIVE_CACHE/llama.cpp/``; :func:`probe` runs any such child.
* :func:`mapped_resident`, :func:`release_mapped_file`: a GGUF file's resident pages, given back
  once llama.cpp has read (and repacked) its weights.
* :func:`seq_state`, :func:`load_seq_state`: a sequence's cells written out of one context and read into
  another (the hybrid engine's handover, :mod:`adaptive.engine.llamacpp_hybrid`); :func:`quantize`: llama.cpp's
  quantizer, which derives a prefill file (:mod:`adaptive.engine.prefill_file`).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import mmap
import os
import platform
import signal
import sys
import threading
from pathlib import Path

from adaptive.engine.gguf_file import GGUFFormatError, read_gguf
from adaptive.errors import ConfigError
from adaptive.workdir import cache_dir, cpu_name, read_json, write_json

INSTALL = "pip install 'adaptive[llamacpp]' (llama-cpp-python; pip builds llama.cpp from source: ~5-10 min on 2 cores)"


def available() -> bool:
    """Whether llama-cpp-python is installed (found, not imported)."""
    return importlib.util.find_spec("llama_cpp") is not None


def default_threads() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def library():
    if not available():
        raise ConfigError(f"the llama.cpp engine needs llama-cpp-python: {INSTALL}")
    import llama_cpp

    return llama_cpp


_INIT_LOCK = threading.Lock()
_LOG_CALLBACK = None  # kept alive: llama.cpp holds the pointer
GGML_MAX_N_THREADS = 512


class _ThreadpoolParams(ctypes.Structure):
    """ggml's ``struct ggml_threadpool_params`` (ggml.h), filled by ``ggml_threadpool_params_init``."""

    _fields_ = [("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS), ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int), ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


def shared_lib(lib, name: str):
    """One of the shared libraries llama-cpp-python ships (``libllama``, ``libggml-base``, ...)."""
    return ctypes.CDLL(str(Path(lib.__file__).parent / "lib" / f"{name}.so"))


def threadpool_api(lib):
    """``(new, free, attach, detach)``: ggml's thread-pool calls and llama.cpp's attach/detach, from the
    shared libraries llama-cpp-python ships (it binds none of them)."""
    base, cpu, llama = (shared_lib(lib, name) for name in ("libggml-base", "libggml-cpu", "libllama"))
    base.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(_ThreadpoolParams), ctypes.c_int]
    base.ggml_threadpool_params_init.restype = None
    cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
    cpu.ggml_threadpool_free.restype = None
    llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    llama.llama_attach_threadpool.restype = None
    llama.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
    llama.llama_detach_threadpool.restype = None

    def new(n_threads: int):
        params = _ThreadpoolParams()
        base.ggml_threadpool_params_init(ctypes.byref(params), n_threads)
        return cpu.ggml_threadpool_new(ctypes.byref(params))

    return new, cpu.ggml_threadpool_free, llama.llama_attach_threadpool, llama.llama_detach_threadpool


# llama.cpp's C++ extension API (src/llama-ext.h, not in llama.h): the input of a layer, per fed token
_SET_LAYER_INP = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"  # (ctx, layer, on)
_GET_LAYER_INP = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"  # (ctx, layer) -> float *


def layer_input_api(lib):
    """``(set, get)``: llama.cpp's layer-input calls, or ``None`` when this build has none."""
    llama = shared_lib(lib, "libllama")
    try:
        set_fn, get_fn = getattr(llama, _SET_LAYER_INP), getattr(llama, _GET_LAYER_INP)
    except AttributeError:
        return None
    set_fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]
    set_fn.restype = None
    get_fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    get_fn.restype = ctypes.POINTER(ctypes.c_float)
    return set_fn, get_fn


_WARNED: set[str] = set()  # what has been said once on stderr


def say_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"adaptive: {message}", file=sys.stderr)


_AMX_BUILD = "AMX_INT8 = 1"  # in llama_print_system_info: the build has llama.cpp's AMX kernels
EXTRA_BUFFERS_FILE = "extra-buffers.json"  # per llama-cpp-python version, machine and weight type: probed or not
_EXTRA_BUFFERS_ENV = "ADAPTIVE_LLAMACPP_EXTRA_BUFFERS"  # "1"/"0": decided, not probed (the probe's own child)
_FAULTS = (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS)  # a child killed by one: the kernels cannot run here


def system_info() -> str:
    """llama.cpp's ``llama_print_system_info``: the CPU features this build was compiled for
    (``"CPU : SSE3 = 1 | ... | AMX_INT8 = 1 | ..."``)."""
    lib = library()
    init_backend(lib)
    info = lib.llama_print_system_info()
    return info.decode(errors="replace") if isinstance(info, bytes) else str(info)


def extra_buffers_ok(gguf: str | Path) -> bool:
    """Whether llama.cpp may load ``gguf``'s weights into its extra CPU buffer types (its AMX and
    repacked layouts) on this machine, said once on stderr when not.

    Where the build has no AMX kernels (:func:`system_info`) the answer is yes and nothing is run. Where
    it has them, a CPU can report AMX while its matrix tiles do not work: seen on an Intel Xeon virtual
    machine (2026-11-27), where the kernel grants the process AMX's tile data but llama.cpp's first
    product faults at ``ldtilecfg``, a segmentation fault of the whole process at the first decode of a
    prompt. So the file is first decoded in a child process with the extra buffers on
    (:func:`_extra_buffers_child`, :func:`_probe`); a child killed by a fault answers no, and an answer is kept in
    ``$ADAPTIVE_CACHE/llama.cpp/extra-buffers.json`` per llama-cpp-python version, machine (host name,
    CPU model, kernel) and weight type (the file's ``general.file_type``). A probe that fails otherwise
    (out of memory, a timeout) answers no for this process only. ``ADAPTIVE_LLAMACPP_EXTRA_BUFFERS=0``
    (or ``1``) decides without a probe. Without the extra buffers every weight stays in the file's own
    layout: the types llama.cpp repacks on x86 (Q4_0, Q4_K, IQ4_NL) lose their multi-row kernels, and
    those its AMX buffer takes (Q4_1 among them) their AMX ones. llama-server's ``--no-repack`` is the
    same switch."""
    forced = os.environ.get(_EXTRA_BUFFERS_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    if _AMX_BUILD not in system_info():
        return True
    path = Path(gguf).resolve()
    if not path.is_file():
        return True  # nothing to probe: loading it fails with its own error
    version = importlib.import_module("llama_cpp").__version__
    safe = probe(EXTRA_BUFFERS_FILE, f"{version}|{machine()}|{_weight_kind(path)}", "extra_buffers_child", path,
                  f"llama.cpp's extra weight layouts on {path.name}", _FAULTS, {**os.environ, _EXTRA_BUFFERS_ENV: "1"})
    if safe is None:
        return False  # the probe itself failed (said): off for this process only
    if not safe:
        say_once(f"llama.cpp's AMX kernels fault on this machine (a probe decoding {path.name} was killed): its "
                  "AMX and repacked weight layouts are off (every weight in the GGUF file's own layout)")
    return safe


def _weight_kind(path: Path) -> str:
    """What decides which of llama.cpp's kernels a file's products run on: its ``general.file_type``
    (llama.cpp's ``LLAMA_FTYPE``: 3 for Q4_1, 15 for Q4_K_M), else the file itself (path and size)."""
    try:
        file_type = read_gguf(path, ("general.file_type",))[0].get("general.file_type")
    except (GGUFFormatError, OSError):
        file_type = None
    return f"file type {file_type}" if isinstance(file_type, int) else f"{path}:{path.stat().st_size}"


def machine() -> str:
    """The host name, CPU model and kernel release: what an answer about this machine's kernels is kept under."""
    return f"{platform.node()}/{cpu_name()}/{platform.release()}"


def probe(cache_name: str, key: str, child: str, path: Path, what: str, answers: tuple[int, ...],
           env: dict | None = None) -> bool | None:
    """What a child process that runs :mod:`adaptive.engine.llamacpp`'s ``child(path)`` says, kept in
    ``$ADAPTIVE_CACHE/llama.cpp/<cache_name>`` under ``key`` (read from there when kept before):
    ``True`` when it printed ``ok``, ``False`` when it printed anything else or a signal in ``answers``
    killed it (what llama.cpp does where it cannot). ``None`` when the probe itself failed (a timeout,
    another exit: out of memory, an import error): said once naming ``what``, nothing kept."""
    import subprocess

    cache = cache_dir() / "llama.cpp" / cache_name
    known = read_cache(cache)
    if isinstance(known.get(key), bool):
        return known[key]
    try:
        run = subprocess.run([sys.executable, "-c", f"import sys; from adaptive.engine.llamacpp import {child}; "
                              f"{child}(sys.argv[1])", str(path)], capture_output=True, text=True, timeout=600,
                             env=env)
    except subprocess.TimeoutExpired:
        return None
    if run.returncode == 0:
        answer = run.stdout.strip().endswith("ok")
    elif -run.returncode in answers:
        answer = False
    else:
        say_once(f"probing {what} failed (exit {run.returncode}): {run.stderr.strip()[-300:]}")
        return None
    write_cache(cache, {**known, key: answer})  # a read-only cache: probed again next time
    return answer


def read_cache(path: Path) -> dict:
    """A cache of answers about this machine (a probe's, measured prefill rates): its object (``{}`` when
    missing, unreadable or not an object)."""
    try:
        known = read_json(path)
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def write_cache(path: Path, value: dict) -> None:
    """Write a cache of answers atomically; a read-only cache is left alone (asked again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, value)
    except OSError:
        pass


def init_backend(lib) -> None:
    """``llama_backend_init`` once, with llama.cpp's own logging silenced (errors surface as ours)."""
    global _LOG_CALLBACK
    with _INIT_LOCK:
        if _LOG_CALLBACK is None:
            _LOG_CALLBACK = lib.llama_log_callback(lambda level, text, user_data: None)
            lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
            lib.llama_backend_init()


def _shared_read_only_maps(path: Path) -> list[tuple[int, int]]:
    """``(start, end)`` of this process's read-only shared mappings of ``path`` (Linux's
    ``/proc/self/maps``; none elsewhere). Only these are safe to drop: nothing can have written to them."""
    try:  # decoded as a path is (a mapped file's name need not be UTF-8)
        lines = os.fsdecode(Path("/proc/self/maps").read_bytes()).splitlines()
    except OSError:
        return []
    target = str(Path(path).resolve())
    spans = []
    for line in lines:
        parts = line.split(maxsplit=5)  # address perms offset dev inode [path, which may hold spaces]
        if len(parts) == 6 and parts[1] == "r--s" and parts[5] == target:
            start, end = (int(a, 16) for a in parts[0].split("-"))
            spans.append((start, end))
    return spans


def mapped_resident(path: str | Path) -> int:
    """Bytes of ``path``'s read-only shared mappings resident in this process (``/proc/self/smaps``;
    0 where there is none or no such file)."""
    spans = set(_shared_read_only_maps(Path(path)))
    if not spans:
        return 0
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", "rb") as f:
            for line in map(os.fsdecode, f):
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(a, 16) for a in head.split("-"))
                    inside = (start, end) in spans
                elif inside and head == "Rss:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def release_mapped_file(path: str | Path) -> int:
    """Drop this process's resident pages of ``path``'s read-only shared mappings (``madvise``
    ``MADV_DONTNEED``); returns the bytes of mappings advised (0 off Linux, or where it failed: a
    memory saving, it never fails the caller).

    llama.cpp maps a GGUF file and, where it has repacked kernels for the file's weight type on this
    CPU (Q4_K on these AVX512 hosts), copies those weights into buffers of its own while loading:
    the file's pages it read stay in the process's resident set though nothing reads them again
    (Qwen2.5-Coder-1.5B's Q4_K_M file: 596 MiB repacked, all 1,060 MiB of the file resident, 1.79 GB
    after loading). Dropped, the pages still in use (the weights left in the file's layout) refault on
    their first read, normally from the page cache (from the disk if the kernel evicted them since);
    the mapping, shared and read-only, holds nothing that could be lost."""
    advice = getattr(mmap, "MADV_DONTNEED", None)  # Linux's
    spans = _shared_read_only_maps(Path(path)) if advice is not None else []
    if not spans:
        return 0
    try:
        madvise = ctypes.CDLL(None).madvise  # the C library's (glibc or musl), in the process already
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    for start, end in spans:
        if madvise(start, end - start, advice) == 0:
            advised += end - start
    return advised


class HandoverError(RuntimeError):
    """llama.cpp refused a sequence's state (a context too full for its cells, or files of different models)."""


def seq_state(lib, ctx, seq: int) -> ctypes.Array:
    """The sequence's state in ``ctx`` (its cells' positions, keys and values), as a byte buffer."""
    size = lib.llama_state_seq_get_size(ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    got = lib.llama_state_seq_get_data(ctx, buf, size, seq)
    if got != size:
        raise HandoverError(f"llama.cpp wrote {got} of sequence {seq}'s {size} state bytes")
    return buf


def load_seq_state(lib, ctx, buf: ctypes.Array, seq: int) -> None:
    """Replace sequence ``seq`` of ``ctx`` with the state in ``buf`` (:func:`seq_state` of another context)."""
    if lib.llama_state_seq_set_data(ctx, buf, len(buf), seq) != len(buf):
        raise HandoverError(f"llama.cpp could not read {len(buf)} state bytes into sequence {seq}")


def quantize(src: Path, dst: Path, ftype: int, lib=None) -> int:
    """Write ``src``'s weights as llama.cpp's file type ``ftype`` (``LLAMA_FTYPE``) to ``dst`` with its quantizer,
    requantizing allowed (a quantized weight is dequantized first), on this process's CPUs: llama.cpp's return
    code (0: written). llama.cpp's log of every tensor is silenced (:func:`init_backend`)."""
    if lib is None:
        lib = library()
    init_backend(lib)
    params = lib.llama_model_quantize_default_params()
    params.nthread = default_threads()
    params.ftype = ftype
    params.allow_requantize = True
    return int(lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)))
