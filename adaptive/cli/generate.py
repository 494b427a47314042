"""``adaptive generate PROMPT``: decode one prompt with ar, ssd, pld or cascade, or through a profile."""

from __future__ import annotations

import click

from adaptive.cli.common import device_option, dtype_option, echo_json, json_option, load, model_option


@click.command("generate")
@click.argument("prompt")
@model_option
@click.option("--profile", "profile_dir", type=click.Path(), default=None,
              help="Calibration profile: route the prompt to its domain's skip set (the runtime).")
@click.option("--method", type=click.Choice(["ar", "ssd", "pld", "cascade", "knn-ssd", "knn-skip", "early-exit",
                                            "draft-model", "ssd-static"]),
              default=None,
              help="ar: plain; ssd: self-speculative with the given skip set; pld: prompt lookup; cascade: prompt lookup "
                   "under one layer-skip position (with a skip set) or alone; with --profile: knn-ssd (routed, the "
                   "default), cascade (the domain's cascade and bigram table), knn-skip (the domain's skip set, always), "
                   "early-exit / draft-model (the drafter `adaptive distill` stored in the profile) "
                   "or ssd-static (the profile's global skip set).  [default: ssd, or knn-ssd with --profile]")
@click.option("--full-vocab", is_flag=True,
              help="With --profile: draft with the full LM head even where the domain has a reduced draft vocabulary.")
@click.option("--skip-attn", default="", help="Attention sublayers to skip while drafting, e.g. 3,5,10-14.")
@click.option("--skip-mlp", default="", help="MLP sublayers to skip while drafting.")
@click.option("--draft-len", type=int, default=4, show_default=True, help="Most tokens drafted per step.")
@click.option("--confidence", type=float, default=None, help="Stop drafting below this draft top probability.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--raw", is_flag=True, help="Encode the prompt as raw text, without the chat template.")
@dtype_option
@device_option
@click.option("--stream", is_flag=True, help="Print text as it is accepted.")
@json_option
def generate_cmd(prompt, model_spec, profile_dir, method, skip_attn, skip_mlp, draft_len, confidence, max_new_tokens,
                 temperature, top_p, top_k, seed, stop, raw, dtype, device, stream, as_json, full_vocab):
    """Decode PROMPT and print the text (or, with --json, text, token_ids and stats)."""
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine
    from adaptive.engine.skip import SkipSet, parse_layer_list

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                           seed=seed, stop=tuple(stop), draft_len=draft_len, confidence_threshold=confidence)
    skip = SkipSet(parse_layer_list(skip_attn), parse_layer_list(skip_mlp))
    method = method or ("knn-ssd" if profile_dir else "ssd")
    if profile_dir:
        return _generate_routed(prompt, model_spec, profile_dir, method, cfg, raw, dtype, device, stream, as_json,
                                bool(skip_attn or skip_mlp), full_vocab)
    if full_vocab:
        raise click.UsageError("--full-vocab needs --profile (without one the full head is always used)")
    if method in ("knn-ssd", "knn-skip", "ssd-static", "early-exit", "draft-model"):
        raise click.UsageError(f"--method {method} needs --profile")
    if method == "ssd" and not skip:
        raise click.UsageError("--method ssd needs a skip set: give --skip-attn and/or --skip-mlp")
    lm = load(model_spec, device, dtype)
    skip.validate_for(lm.n_layers)
    engine = Engine(lm)
    result = _print_stream(engine.stream(prompt, cfg, method=method, skip=skip if method in ("ssd", "cascade") else None,
                                         chat=False if raw else None), lm, stream, as_json)
    if as_json:
        return
    s = result.stats
    click.echo(f"[{method}] {s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance {s.acceptance_rate:.2f}, "
               f"{s.mean_accepted_tokens:.2f} tokens/step", err=True)


def _generate_routed(prompt, model_spec, profile_dir, method, cfg, raw, dtype, device, stream, as_json, has_skip,
                     full_vocab=False):
    """``generate --profile``: the runtime routes the prompt and picks skip set and draft lengths."""
    from adaptive.models import DEFAULT_MODEL
    from adaptive.runtime import AdaptiveRuntime

    if method in ("ssd", "pld") or has_skip:
        raise click.UsageError("with --profile the skip set comes from the profile: use --method knn-ssd, cascade, "
                               "knn-skip, early-exit, draft-model, ssd-static or ar")
    if raw:
        raise click.UsageError("with --profile the prompt is encoded as at calibration; --raw does not apply")
    click.echo(f"loading profile {profile_dir} ...", err=True)
    rt = AdaptiveRuntime.from_profile(profile_dir, model=None if model_spec == DEFAULT_MODEL else model_spec,
                                      device=device, dtype=None if dtype == "auto" else dtype,
                                      reduced_vocab=not full_vocab)
    items = rt.stream(prompt, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                      top_k=cfg.top_k, stop=cfg.stop, seed=cfg.seed, method=method,
                      confidence_threshold=cfg.confidence_threshold)
    result = _print_stream(items, rt.lm, stream, as_json)
    if as_json:
        return
    s = result.stats
    where = "out-of-domain (global set)" if result.domain is None else f"domain {result.domain}"
    click.echo(f"[{method}] {where}, decoded with {result.decision}"
               + (f" (skip {result.skip}, draft lengths {dict(sorted(result.draft_lengths.items()))})"
                  if result.decision in ("ssd", "cascade") and result.skip else "")
               + (f" (draft lengths {dict(sorted(result.draft_lengths.items()))})"
                  if result.decision in ("early-exit", "draft-model") else "")
               + f": {s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance {s.acceptance_rate:.2f}", err=True)


def _print_stream(items, lm, stream: bool, as_json: bool):
    """Print text deltas (``--stream``), then the text or the JSON object; return the result."""
    result = None
    for item in items:
        if isinstance(item, str):
            if stream and not as_json:
                click.echo(item, nl=False)
        else:
            result = item
    if as_json:
        echo_json({**result.to_dict(), "model": lm.name, "dtype": str(lm.dtype).replace("torch.", "")})
    elif stream:
        click.echo()
    else:
        click.echo(result.text)
    return result
