"""What the commands share: the command class (examples, a list of terms, hints for misplaced
options), click types for the options that are more than a number, and the shared options."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import click

from adaptive.engine.config import GenerationConfig
from adaptive.engine.prefill_file import DEFAULT_PREFILL
from adaptive.engine.prefill_file import check_mode as check_prefill_mode
from adaptive.engine.quant import WEIGHT_MODES
from adaptive.engine.skip import SkipSetError, parse_layer_list
from adaptive.errors import ConfigError
from adaptive.models import DEFAULT_MODEL, EMBEDDED_MODELS, ENGINES, load_model

DTYPES = ("auto", "float32", "bfloat16", "float16")


# -- the command class -------------------------------------------------------------------------


class Command(click.Command):
    """A click command whose ``--help`` ends with a list of terms (``terms=(title, {name: text})``,
    e.g. the drafters a ``--drafter`` choice offers) and ``examples`` (kept line by line).

    ``hints`` (option -> sentence) turn an option this command does not have, or a required one
    that is missing, into an error that says which command does take it.
    """

    def __init__(self, *args, examples: tuple[str, ...] = (), terms: tuple[str, Mapping[str, str]] | None = None,
                 hints: Mapping[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.examples = tuple(examples)
        self.terms = terms
        self.hints = dict(hints or {})

    def format_epilog(self, ctx, formatter) -> None:
        if self.terms:
            title, rows = self.terms
            with formatter.section(title):
                formatter.write_dl(list(rows.items()))
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:  # one per line, never re-wrapped
                    formatter.write(f"{'':>{formatter.current_indent}}{line}\n")
        super().format_epilog(ctx, formatter)

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if exc.option_name in self.hints:
                raise click.UsageError(f"no such option {exc.option_name}: {self.hints[exc.option_name]}",
                                       ctx=ctx) from None
            raise
        except click.MissingParameter as exc:
            hint = next((self.hints[o] for o in getattr(exc.param, "opts", ()) if o in self.hints), None)
            if hint:
                raise click.UsageError(f"{exc.format_message().rstrip('.')}; {hint}", ctx=ctx) from None
            raise


def command(name: str, **kwargs):
    """``@click.command(name, cls=Command, ...)``."""
    return click.command(name, cls=Command, **kwargs)


# -- click types -------------------------------------------------------------------------------


class LayerList(click.ParamType):
    """``3,5,10-14`` -> ``(3, 5, 10, 11, 12, 13, 14)`` (0-based sublayer indices; empty or
    ``none``: no layer), with :func:`adaptive.engine.skip.parse_layer_list`."""

    name = "LIST"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return parse_layer_list(str(value))
        except SkipSetError as exc:
            self.fail(str(exc), param, ctx)


class NameEqualsPath(click.ParamType):
    """``NAME=PATH`` -> ``(NAME, Path(PATH))``; with ``bare=True`` a plain ``PATH`` is allowed too,
    named by the file's stem (``x/maths.jsonl`` -> ``("maths", Path("x/maths.jsonl"))``). Whether
    the file exists and reads is checked when it is read (:func:`adaptive.calibrate.sources.read_prompt_rows`)."""

    def __init__(self, bare: bool = False):
        self.bare = bare
        self.name = "[NAME=]PATH" if bare else "NAME=PATH"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        name, sep, path = str(value).partition("=")
        if not sep and self.bare:
            name, path = Path(value).stem, value
        name, path = name.strip(), path.strip()
        if not (sep or self.bare) or not name or not path:
            self.fail(f"takes {self.name}, got {value!r}", param, ctx)
        return name, Path(path)


class Device(click.ParamType):
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (a GPU by index)."""

    name = "auto|cpu|cuda[:N]"

    def convert(self, value, param, ctx):
        text = str(value).strip().lower()
        kind, sep, index = text.partition(":")
        if text in ("auto", "cpu", "cuda") or (kind == "cuda" and sep and index.isdigit()):
            return text
        self.fail(f"{value!r} is not auto, cpu, cuda or cuda:N", param, ctx)


class SizeList(click.ParamType):
    """``2048,4096`` -> ``(2048, 4096)``; ``none`` -> ``()``."""

    name = "LIST"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value).strip().lower()
        if text == "none":
            return ()
        try:
            return tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            self.fail(f"not 'none' or a comma-separated list of integers: {value!r}", param, ctx)


class NameList(click.ParamType):
    """A comma-separated list of names from ``choices`` (a mapping or sequence), each at most once:
    ``"ar,knn-ssd"`` -> ``("ar", "knn-ssd")``."""

    name = "LIST"

    def __init__(self, choices, noun: str = "name"):
        self.choices = tuple(choices)
        self.noun = noun

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        names = tuple(n.strip() for n in str(value).split(",") if n.strip())
        unknown = [n for n in names if n not in self.choices]
        if unknown:
            self.fail(f"unknown {self.noun}(s) {', '.join(unknown)}; choose from {', '.join(self.choices)}", param, ctx)
        if not names:
            self.fail(f"no {self.noun} given", param, ctx)
        if len(set(names)) != len(names):
            self.fail(f"a {self.noun} is listed twice in {value!r}", param, ctx)
        return names


class MessagesFile(click.ParamType):
    """A JSON file (``-``: standard input) holding a conversation: a non-empty list of
    ``{"role": ..., "content": ...}`` objects whose fields are strings, as OpenAI's API takes them."""

    name = "FILE"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            text = sys.stdin.read() if value == "-" else Path(value).read_text(encoding="utf-8")
        except OSError as exc:
            self.fail(f"cannot read {value}: {exc.strerror or exc}", param, ctx)
        try:
            messages = json.loads(text)
        except json.JSONDecodeError as exc:
            self.fail(f"{value} is not JSON ({exc.msg} at line {exc.lineno})", param, ctx)
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            self.fail(f"{value} must hold a non-empty JSON list of {{\"role\": ..., \"content\": ...}} objects "
                      "with string fields", param, ctx)
        return [{"role": m["role"], "content": m["content"]} for m in messages]


def domain_prompts(pairs, option: str) -> dict[str, list[str]]:
    """Prompts per domain from ``(name, path)`` pairs (:class:`NameEqualsPath`), or the built-in
    domains when there are none."""
    from adaptive.calibrate.prompts import builtin_domains
    from adaptive.calibrate.sources import read_prompt_rows

    if not pairs:
        return builtin_domains()
    names = [n for n, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise click.BadParameter(f"domain {twice[0]!r} is given twice", param_hint=option)
    return {name: [r["prompt"] for r in read_prompt_rows(path)] for name, path in pairs}


# -- shared options ----------------------------------------------------------------------------

model_option = click.option("--model", "model_spec", default=DEFAULT_MODEL, show_default=True,
                            help=f"{' or '.join(EMBEDDED_MODELS)} (embedded; the second needs the "
                                 "extra qwen15), a .gguf file, a local HF directory, or a cached hub id.")
dtype_option = click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
                            help="auto: bf16 where the CPU/GPU computes it natively (with a profile: its dtype).")
weights_option = click.option(
    "--weights", type=click.Choice(["auto", *WEIGHT_MODES]), default="auto", show_default=True,
    help="How the torch engine stores the linear layers: dense (--dtype's), packed (the same values in oneDNN's "
         "layout: faster on a CPU), int8 or int4 weight-only quantization (CPU; fewer bytes read per step). auto: "
         "packed on a CPU that computes --dtype with oneDNN, else dense; with a profile, the profile's.")
engine_option = click.option(
    "--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
    help="torch: our backbone (layer skipping, early exit, CUDA); llama.cpp: llama.cpp's kernels on the GGUF file "
         "itself (faster on a CPU; statistical drafters only). auto: llama.cpp for a GGUF model on the CPU when "
         "llama-cpp-python is installed and neither --dtype nor --weights is set (calibrate: both engines, one "
         "two-engine profile); with a profile, its engine (a two-engine profile: each request on the engine "
         "expected to finish it first).")
prefill_option = click.option(
    "--prefill-model", "prefill", default=DEFAULT_PREFILL, show_default=True, callback=lambda c, p, v: _prefill(v),
    help="The llama.cpp engine's prefill file: prompts are prefilled on it and handed to the GGUF file, which "
         "decodes (on a CPU llama.cpp's BF16 kernels prefill a Q4_1 model's prompts ~3x faster and decode slower). "
         "auto: of a BF16 copy (derived once into the cache where it fits in half the available memory, else "
         "Q8_0) and the GGUF file without llama.cpp's repacked layouts, the faster prefill where it is >= 1.25x "
         "the file's own, measured once per machine; else none. off; bf16, f16, q8_0; no-repack; or a path to a "
         "GGUF file of the same model.")
device_option = click.option("--device", type=Device(), default="auto", show_default=True,
                             help="auto: CUDA when present, else the CPU; cuda:N picks a GPU.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
quiet_option = click.option("--quiet", is_flag=True, help="No progress bars.")


def sampling_options(f):
    """The options of :class:`GenerationConfig` that ``decode`` and ``generate`` share; they reach
    the command as keyword arguments named like the config's fields."""
    options = [
        click.option("--max-new-tokens", "max_new_tokens", type=int, default=128, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-p", "top_p", type=float, default=1.0, show_default=True),
        click.option("--top-k", "top_k", type=int, default=0, show_default=True, help="0: off."),
        click.option("--seed", type=int, default=None, help="Sampling seed."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); the text is cut before it."),
        click.option("--confidence", "confidence_threshold", type=float, default=None,
                     help="Stop a draft below this draft top probability."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def sampling_config(sampling: dict, **more) -> GenerationConfig:
    """The :class:`GenerationConfig` of the shared options (validated before any model loads)."""
    return GenerationConfig(**sampling, **more)


# -- helpers -----------------------------------------------------------------------------------


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, ensure_ascii=False))


def info(message: str) -> None:
    """A progress or summary line: stderr, so that stdout holds only the result."""
    click.echo(message, err=True)


def _prefill(value: str) -> str:
    try:
        return check_prefill_mode(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


def load(model_spec: str, device: str, dtype: str, weights: str = "auto", engine: str = "auto",
         threads: int | None = None, prefill: str = DEFAULT_PREFILL):
    lm = load_model(model_spec, device=device, dtype=dtype, weights=weights,
                    engine=engine, threads=threads, prefill=prefill)
    info(f"loaded {model_spec} on the {lm.engine} engine")
    return lm


def model_given(model_spec: str) -> bool:
    """``--model`` was given on the command line (its default, even typed out, is ``True`` too);
    outside a click command: ``model_spec`` is not the default."""
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source("model_spec") if ctx is not None else None
    if source is None:
        return model_spec != DEFAULT_MODEL
    return source is not click.core.ParameterSource.DEFAULT


def load_runtime(profile_dir, model_spec: str, device: str, dtype: str, weights: str = "auto", engine: str = "auto",
                 **kwargs):
    """The runtime of a profile, with the model, dtype, weights and engine it names unless ``--model``/
    ``--dtype``/``--weights``/``--engine`` say otherwise (``kwargs``: :class:`AdaptiveRuntime`'s own options);
    both engines of a two-engine profile unless ``--engine`` names one."""
    from adaptive.runtime.engines import open_runtime

    info(f"loading profile {profile_dir} ...")
    return open_runtime(profile_dir, model=model_spec if model_given(model_spec) else None,
                        device=device, dtype=None if dtype == "auto" else dtype,
                        weights=None if weights == "auto" else weights,
                        engine=None if engine == "auto" else engine, **kwargs)


def profile_model(profile, model_spec: str, dtype: str, weights: str = "auto",
                  engine: str = "auto") -> tuple[str, str, str, str]:
    """The model spec, dtype, weights and engine to load for ``profile``: its own unless ``--model``/
    ``--dtype``/``--weights``/``--engine`` say otherwise (on llama.cpp the dtype is the GGUF file's: ``auto``)."""
    spec = model_spec if model_given(model_spec) else (profile.model.spec or DEFAULT_MODEL)
    eng = profile.model.engine if engine == "auto" else engine
    dt = (profile.model.dtype or "auto") if dtype == "auto" else dtype
    return spec, "auto" if eng != "torch" and dtype == "auto" else dt, \
        profile.model.weights if weights == "auto" else weights, eng
