"""The prefill file of the hybrid llama.cpp engine: a copy of the user's GGUF in a format whose kernels
prefill fastest, derived once and cached (see :mod:`adaptive.engine.llamacpp_hybrid` for the engine).

llama.cpp has no file that is best at both phases of a request on a CPU: its quantized kernels decode
fastest (a step reads the fewest bytes) while its BF16 kernels prefill several times faster (a prompt's
rows are a matrix product, where the quantized kernels are compute-bound). Measured with llama-bench
on the embedded model, 2 threads, AMD EPYC (docs/design.md, "Prefill on the fastest weights"):
Q4_1 pp512 502 tok/s and tg64 198 tok/s; BF16 of the same weights 1,996 and 138.

Terms:

* **decode file**: the GGUF the user gave, whose context decodes and verifies.
* **prefill file**: the same weights in :data:`PREFILL_KINDS` (``bf16``, ``f16`` or ``q8_0``), whose
  context prefills prompts. Derived by llama.cpp's own quantizer (``llama_model_quantize``, requantizing
  allowed: each weight is dequantized to float32, then stored in the new type; F32 tensors stay F32), into
  ``$ADAPTIVE_CACHE/prefill/``, keyed by the decode file's path, size and modification time, written to a
  temporary name and renamed (atomic: an interrupted derivation leaves nothing behind).
* **prefill mode** (:data:`PREFILL_MODES`, ``--prefill-model``): ``auto`` measures two candidates, a copy (``bf16``,
  else ``q8_0`` where BF16 does not fit the memory budget, :func:`fits_memory`) and the decode file itself without
  llama.cpp's repacked layouts (:data:`NO_REPACK`), and takes the faster of those that **pay**: a prefill rate at
  least :data:`PAYS` times the decode file's on this machine (:func:`measured_rates`), else none; ``off``: none;
  a kind: that one, whatever the budget or the rates; anything else: a path to a GGUF file of the same model. A
  decode file that is already unquantized (F32, F16, BF16) is its own best prefill file: ``auto`` gives none.

Whether a prefill file pays is measured, not assumed: it depends on the kernels the decode file's type gets
here. On the embedded model's Q4_1 (not repacked on x86) a BF16 copy prefilled 2.3-3.3x faster and the file
without repacking slower; on Qwen2.5-Coder-1.5B's Q4_K_M (repacked into llama.cpp's multi-row kernels) BF16
prefilled at 0.8-1.1x its rate and the file without repacking 1.6x (docs/design.md, the formats table; AMD EPYC
Zen 4, 2 threads). :func:`measured_rates` times a prefill of :data:`RATE_TOKENS` tokens on each file (llama.cpp's
own kernels, the machine's threads), once per machine and file, the answers kept in
``$ADAPTIVE_CACHE/prefill/rates.json``; a copy that does not pay is deleted again (a BF16 copy of a 1.5B model is
3.4 GB).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adaptive.engine.gguf_file import GGUFFormatError, read_gguf
from adaptive.engine.llamacpp_host import machine, quantize, read_cache, write_cache
from adaptive.errors import ConfigError, ModelNotFoundError
from adaptive.workdir import cache_dir

# llama.cpp's LLAMA_FTYPE of each kind a prefill file may be derived in, and its bytes per weight
PREFILL_KINDS = {"bf16": (32, 2.0), "f16": (1, 2.0), "q8_0": (7, 34 / 32)}
# every kind :func:`derive` writes (the formats table of benchmarks/formats.py compares Q4_0 too)
DERIVED_KINDS = {**PREFILL_KINDS, "q4_0": (2, 18 / 32), "q4_1": (3, 20 / 32)}
# the decode file itself, read by a context without llama.cpp's repacked weight layouts (llama-server's
# --no-repack): on Qwen2.5-Coder-1.5B's Q4_K_M they decode 7% faster but prefill 1.6x slower (the formats table)
NO_REPACK = "no-repack"
PREFILL_MODES = ("auto", "off", *PREFILL_KINDS, NO_REPACK)
KINDS = (*PREFILL_KINDS, NO_REPACK, "file")
DEFAULT_PREFILL = "auto"
UNQUANTIZED_FILE_TYPES = (0, 1, 32)  # general.file_type of an F32, F16 or BF16 file: nothing to derive
# the share of this machine's available memory a derived copy may take (the decode file, the torch engine's
# weights and every context's KV cache need the rest)
MEMORY_SHARE = 0.5
# auto's hybrid must prefill at least this many times faster than the decode file: it maps a second copy of the
# weights and hands every prompt over, and the rates are measured once, on a machine whose noise is ~10%
PAYS = 1.25
RATE_TOKENS = 256  # the prompt a prefill rate is measured on
RATES_FILE = "rates.json"


@dataclass(frozen=True)
class PrefillFile:
    """Where a hybrid engine's prompts are prefilled: ``path``, and ``kind`` (a :data:`PREFILL_KINDS` key,
    :data:`NO_REPACK` for the decode file itself in its own layout, or ``"file"`` for one the user named), what
    a profile records and results show. ``repack``: whether its context may use llama.cpp's repacked layouts."""

    path: Path
    kind: str
    repack: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a prefill file's kind is one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == NO_REPACK) == self.repack:
            raise ValueError(f"a prefill file has its repacked layouts off exactly when its kind is {NO_REPACK}")


def check_mode(mode: str) -> str:
    """``mode`` if it is a :data:`PREFILL_MODES` entry or an existing file, else a :class:`ConfigError`."""
    if mode in PREFILL_MODES or Path(mode).expanduser().is_file():
        return mode
    raise ConfigError(f"--prefill-model {mode!r} is neither one of {', '.join(PREFILL_MODES)} nor a GGUF file")


def resolve_prefill(decode_file: str | Path, mode: str = DEFAULT_PREFILL, lib=None,
                    rate: Callable[[Path], float] | None = None) -> PrefillFile | None:
    """The prefill file for ``decode_file`` under ``mode`` (see the module docstring), derived now when
    it is not cached yet; ``None`` for no hybrid. ``lib``: llama-cpp-python (imported when needed); ``rate``:
    a GGUF file's prefill rate in tokens per second (:func:`adaptive.engine.llamacpp.prefill_rate`), which
    ``auto`` needs."""
    check_mode(mode)
    if mode == "off":
        return None
    if mode not in PREFILL_MODES:
        path = Path(mode).expanduser().resolve()
        if path == Path(decode_file).resolve():
            return None  # the decode file itself: no hybrid
        return PrefillFile(path, "file")
    if mode == NO_REPACK:
        return PrefillFile(Path(decode_file).resolve(), NO_REPACK, repack=False)
    if mode == "auto":
        if file_type(decode_file) in UNQUANTIZED_FILE_TYPES:
            return None
        if rate is None:
            raise ValueError("auto needs rate: a function measuring a GGUF file's prefill rate")
        copy = next((k for k in ("bf16", "q8_0") if fits_memory(decode_file, k)), None)
        rates = measured_rates(decode_file, [k for k in (copy, NO_REPACK) if k], rate, lib)
        paying = [k for k, r in rates.items() if k != "decode" and r >= PAYS * rates["decode"]]
        chosen = max(paying, key=rates.get) if paying else None
        if copy is not None and copy != chosen:
            derived_path(decode_file, copy).unlink(missing_ok=True)  # derived to be measured, not taken
        return None if chosen is None else resolve_prefill(decode_file, chosen, lib)
    return PrefillFile(derive(decode_file, mode, lib), mode)


def measured_rates(decode_file: str | Path, kinds: list[str], rate: Callable[[Path, bool], float],
                   lib=None) -> dict[str, float]:
    """``{"decode": r, kind: r, ...}``: the prefill rates (tokens per second) of ``decode_file`` as it decodes and
    of each candidate prefill file, measured once per machine and file (deriving the copies) and kept in
    :data:`RATES_FILE` beside the copies. ``rate(path, repack)``: one file's rate."""
    store = cache_dir() / "prefill" / RATES_FILE
    key = f"{machine()}/{os.cpu_count()}|{_file_key(decode_file)}"
    known = dict(read_cache(store).get(key, {}))
    if not all(k in known for k in ("decode", *kinds)):
        if "decode" not in known:
            known["decode"] = round(rate(Path(decode_file), True), 1)
        for kind in kinds:
            if kind not in known:
                path = Path(decode_file) if kind == NO_REPACK else derive(decode_file, kind, lib)
                known[kind] = round(rate(path, kind != NO_REPACK), 1)
        write_cache(store, {**read_cache(store), key: known})  # with another process's answers since
    return {k: known[k] for k in ("decode", *kinds)}


def file_type(path: str | Path) -> int | None:
    """The GGUF file's ``general.file_type`` (llama.cpp's LLAMA_FTYPE), ``None`` when it has none."""
    try:
        value = read_gguf(Path(path), ("general.file_type",))[0].get("general.file_type")
    except (GGUFFormatError, OSError) as exc:
        raise ModelNotFoundError(f"cannot read GGUF file {path}: {exc}") from exc
    return value if isinstance(value, int) else None


def weights_count(path: str | Path) -> int:
    """The number of weights (elements of every tensor) in a GGUF file, from its tensor table."""
    from gguf import GGUFReader

    return int(sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors))


def derived_bytes(path: str | Path, kind: str) -> int:
    """The size of ``path``'s copy in ``kind`` (its weights at :data:`DERIVED_KINDS`' bytes per weight)."""
    return int(weights_count(path) * DERIVED_KINDS[kind][1])


def available_memory() -> int:
    """Bytes of memory this machine has available now (``MemAvailable``; the physical total elsewhere)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fits_memory(path: str | Path, kind: str, available: int | None = None) -> bool:
    """Whether ``path``'s copy in ``kind`` fits :data:`MEMORY_SHARE` of the memory available now
    (``available``: bytes, instead of :func:`available_memory`; a copy already derived fits the same)."""
    have = available_memory() if available is None else available
    return derived_bytes(path, kind) <= MEMORY_SHARE * have


def derived_path(decode_file: str | Path, kind: str) -> Path:
    """Where ``decode_file``'s copy in ``kind`` is cached: keyed by the file's resolved path, size and
    modification time (a file replaced in place gets a new copy)."""
    return cache_dir() / "prefill" / f"{_file_key(decode_file)}.{kind}.gguf"


def _file_key(path: str | Path) -> str:
    """``STEM-HASH``: a file's stem and a hash of its resolved path, size and modification time."""
    src = Path(path).resolve()
    st = src.stat()
    return f"{src.stem}-{hashlib.sha256(f'{src}|{st.st_size}|{st.st_mtime_ns}'.encode()).hexdigest()[:12]}"


def derive(decode_file: str | Path, kind: str, lib=None) -> Path:
    """``decode_file``'s weights in ``kind``, cached (:func:`derived_path`); derived now with llama.cpp's
    quantizer when not cached yet (the embedded model: ~1 s; a 1.5B model: tens of seconds)."""
    if kind not in DERIVED_KINDS:
        raise ConfigError(f"a GGUF file is derived as one of {', '.join(DERIVED_KINDS)}, not {kind!r}")
    src = Path(decode_file)
    if not src.is_file():
        raise ModelNotFoundError(f"GGUF file {src} does not exist")
    target = derived_path(src, kind)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        rc = quantize(src, tmp, DERIVED_KINDS[kind][0], lib)
        if rc != 0 or not tmp.is_file():
            raise ConfigError(f"llama.cpp could not derive a {kind} copy of {src} (error {rc})")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
