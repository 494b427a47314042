"""Options and helpers shared by the commands."""

from __future__ import annotations

import json

import click

from adaptive.models import DEFAULT_MODEL

model_option = click.option("--model", "model_spec", default=DEFAULT_MODEL, show_default=True,
                            help="smollm2-135m, a .gguf file, a local HF directory, or a cached hub id.")
dtype_option = click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                            default="auto", show_default=True, help="auto: bf16 where the CPU/GPU computes it natively.")
device_option = click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, ensure_ascii=False))


def load(model_spec: str, device: str, dtype: str):
    from adaptive.models import load_model

    click.echo(f"loading {model_spec} ...", err=True)
    return load_model(model_spec, device=device, dtype=dtype)


def profile_model(profile, model_spec: str, dtype: str) -> tuple[str, str]:
    """The model spec and dtype to load for ``profile``: its own unless ``--model``/``--dtype`` say otherwise."""
    spec = profile.model.get("spec", DEFAULT_MODEL) if model_spec == DEFAULT_MODEL else model_spec
    return spec, profile.model.get("dtype", "auto") if dtype == "auto" else dtype
