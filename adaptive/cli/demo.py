"""``adaptive demo``: the README's main job on the embedded default model."""

from __future__ import annotations

import statistics

import click

from adaptive.cli.common import device_option, dtype_option, echo_json, json_option, load, model_option

# Hand-found on the embedded model (bf16): attention sublayers whose removal keeps drafts closest
# to the full model per unit of cost (see docs/results.md). Calibration replaces it per domain.
DEFAULT_DEMO_SKIP = "attn=4,7,9,20,25"


@click.command("demo")
@model_option
@click.option("--skip", "skip_text", default=DEFAULT_DEMO_SKIP, show_default=True,
              help="Skip set for ssd, e.g. 'attn=4,7;mlp=2'.")
@click.option("--draft-len", type=int, default=2, show_default=True,
              help="Fixed draft length (2 measured best for the default skip set).")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per method (median).")
@dtype_option
@device_option
@json_option
def demo_cmd(model_spec, skip_text, draft_len, max_new_tokens, repeats, dtype, device, as_json):
    """Decode a built-in prompt with ar and ssd; print whether outputs are identical and the speed ratio."""
    from adaptive.calibrate.prompts import builtin_domains
    from adaptive.engine.audit import audit_divergence
    from adaptive.engine.config import GenerationConfig
    from adaptive.engine.engine import Engine
    from adaptive.engine.skip import SkipSet

    if repeats < 1:
        raise click.BadParameter("must be >= 1", param_hint="--repeats")
    lm = load(model_spec, device, dtype)
    skip = SkipSet.from_text(skip_text, lm.n_layers)
    engine = Engine(lm)
    prompt = builtin_domains()["math"][0]
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=draft_len)
    engine.generate(prompt, GenerationConfig(max_new_tokens=8))  # warm-up
    runs = {"ar": [], "ssd": []}
    results = {}
    for _ in range(repeats):  # interleaved so that machine drift hits both alike
        for method in ("ar", "ssd"):
            r = engine.generate(prompt, cfg, method=method, skip=skip if method == "ssd" else None)
            runs[method].append(r.stats.tokens_per_s)
            results[method] = r
    ar_tps, ssd_tps = statistics.median(runs["ar"]), statistics.median(runs["ssd"])
    audit = audit_divergence(lm.backbone, engine.encode(prompt), results["ar"].token_ids, results["ssd"].token_ids)
    out = {
        "model": lm.name, "dtype": str(lm.dtype).replace("torch.", ""), "prompt": prompt,
        "skip": skip.to_text(), "identical": audit.identical, "audit": audit.to_dict(),
        "ar_tokens_per_s": round(ar_tps, 2), "ssd_tokens_per_s": round(ssd_tps, 2),
        "speedup": round(ssd_tps / ar_tps, 3),
        "acceptance_rate": round(results["ssd"].stats.acceptance_rate, 3),
        "mean_accepted_tokens": round(results["ssd"].stats.mean_accepted_tokens, 3),
        "text": results["ssd"].text,
    }
    if as_json:
        echo_json(out)
        return
    click.echo(f"prompt: {prompt}\n")
    click.echo(results["ssd"].text + "\n")
    click.echo(f"model {out['model']} ({out['dtype']}), skip set {out['skip']}, draft length {draft_len}")
    click.echo(f"ar : {ar_tps:.1f} tok/s")
    click.echo(f"ssd: {ssd_tps:.1f} tok/s, acceptance {out['acceptance_rate']:.2f}, "
               f"{out['mean_accepted_tokens']:.2f} tokens/step")
    same = "yes" if audit.identical else (
        f"no: first difference at token {audit.position}, margin {audit.margin:.3f} "
        f"({'LOSSLESS VIOLATION' if audit.violation else 'a near-tie within bf16 rounding'})")
    click.echo(f"identical output: {same}")
    click.echo(f"speedup ssd/ar: {out['speedup']:.2f}x (median of {repeats})")
