"""``adaptive generate PROMPT``: decode one prompt with ar or ssd."""

from __future__ import annotations

import click

from adaptive.cli.common import device_option, dtype_option, echo_json, json_option, load, model_option


@click.command("generate")
@click.argument("prompt")
@model_option
@click.option("--method", type=click.Choice(["ar", "ssd"]), default="ssd", show_default=True,
              help="ar: plain decoding; ssd: self-speculative with the given skip set.")
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
def generate_cmd(prompt, model_spec, method, skip_attn, skip_mlp, draft_len, confidence, max_new_tokens,
                 temperature, top_p, top_k, seed, stop, raw, dtype, device, stream, as_json):
    """Decode PROMPT and print the text (or, with --json, text, token_ids and stats)."""
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine
    from adaptive.engine.skip import SkipSet, parse_layer_list

    cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                           seed=seed, stop=tuple(stop), draft_len=draft_len, confidence_threshold=confidence)
    skip = SkipSet(parse_layer_list(skip_attn), parse_layer_list(skip_mlp))
    if method == "ssd" and not skip:
        raise click.UsageError("--method ssd needs a skip set: give --skip-attn and/or --skip-mlp")
    lm = load(model_spec, device, dtype)
    skip.validate_for(lm.n_layers)
    engine = Engine(lm)
    result = None
    for item in engine.stream(prompt, cfg, method=method, skip=skip if method == "ssd" else None,
                              chat=False if raw else None):
        if isinstance(item, str):
            if stream and not as_json:
                click.echo(item, nl=False)
        else:
            result = item
    if as_json:
        echo_json({**result.to_dict(), "model": lm.name, "dtype": str(lm.dtype).replace("torch.", "")})
        return
    if stream:
        click.echo()
    else:
        click.echo(result.text)
    s = result.stats
    click.echo(f"[{method}] {s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance {s.acceptance_rate:.2f}, "
               f"{s.mean_accepted_tokens:.2f} tokens/step", err=True)
