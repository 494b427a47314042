"""``adaptive distill``: train a drafter towards the target (DistillSpec) and store it in a profile."""

from __future__ import annotations

import click

from adaptive.cli.common import (
    NameEqualsPath,
    command,
    device_option,
    domain_prompts,
    dtype_option,
    echo_json,
    info,
    json_option,
    load,
    model_option,
    profile_model,
    quiet_option,
)
from adaptive.distill.data import DATA_SOURCES
from adaptive.distill.divergences import DIVERGENCES
from adaptive.distill.trainer import DistillConfig, distill
from adaptive.profile import load_profile

EARLY_EXIT = "early-exit"


@command("distill", examples=(
    "adaptive distill --profile my-profile",
    "adaptive distill --profile my-profile --data code.jsonl --data maths=maths.txt --divergence tvd --steps 600",
    "adaptive distill --profile my-profile --drafter draft-model.gguf --data-source on-policy",
    "adaptive distill --profile my-profile --resume",
), hints={"--domains": "distill takes its prompts with --data [NAME=]PATH"})
@model_option
@click.option("--profile", "profile_dir", required=True, type=click.Path(),
              help="The profile to train for; the drafter is stored in it (atomically).")
@click.option("--drafter", default=EARLY_EXIT, show_default=True, metavar="early-exit|MODEL",
              help="early-exit: the first --exit-layer layers plus a trained exit block; or a separate draft model "
                   "(a spec as for --model) sharing the target's tokenizer, fine-tuned whole.")
@click.option("--exit-layer", type=int, default=None, help="Layers the early-exit drafter runs [half the model's].")
@click.option("--data", "data", multiple=True, type=NameEqualsPath(bare=True),
              help="Prompts to train on, one domain per file (JSONL or .txt); repeatable. "
                   "Default: the built-in domains.")
@click.option("--divergence", type=click.Choice(DIVERGENCES), default=DIVERGENCES[0], show_default=True,
              help="Token-level loss between p (target) and q (drafter); tvd bounds acceptance directly.")
@click.option("--jsd-beta", type=float, default=0.5, show_default=True, help="beta of the generalised JSD.")
@click.option("--data-source", type=click.Choice(DATA_SOURCES), default="teacher",
              show_default=True,
              help="fixed: the prompt text; teacher: the target's greedy continuations; on-policy: the drafter's own "
                   "samples, scored by the target; mixed: half and half.")
@click.option("--steps", type=int, default=300, show_default=True,
              help="Optimiser steps (0: store the untrained drafter).")
@click.option("--lr", type=float, default=1e-3, show_default=True, help="AdamW learning rate.")
@click.option("--batch-size", type=int, default=64, show_default=True,
              help="Token positions per step (early-exit) or sequences per step (draft model).")
@click.option("--new-tokens", type=int, default=48, show_default=True, help="Tokens generated per prompt for the data.")
@click.option("--prompts-per-domain", type=int, default=16, show_default=True,
              help="First N prompts of each domain; the last quarter of them is held out for evaluation.")
@click.option("--refresh-every", type=int, default=100, show_default=True,
              help="Steps between resamplings of on-policy data from the drafter being trained.")
@click.option("--eval-every", type=int, default=25, show_default=True, help="Steps between held-out evaluations.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Where to save the loss and acceptance curves (PNG) [PROFILE.KIND-distill.png].")
@click.option("--resume", is_flag=True, help="Continue an interrupted distillation from its last checkpoint.")
@click.option("--seed", type=int, default=0, show_default=True)
@dtype_option
@device_option
@quiet_option
@json_option
def distill_cmd(model_spec, profile_dir, drafter, exit_layer, data, divergence, jsd_beta, data_source, steps, lr,
                batch_size, new_tokens, prompts_per_domain, refresh_every, eval_every, plot, resume, seed, dtype,
                device, quiet, as_json):
    """Distill a drafter for the profile's model and store it in the profile.

    early-exit: the target's first --exit-layer layers plus a trained exit block; MODEL: a
    separate draft model sharing the target's tokenizer, fine-tuned whole. The drafter is then
    used by `adaptive generate --profile DIR --policy early-exit|draft-model` and `adaptive bench`.
    """
    if drafter == "skip":
        raise click.UsageError(f"adapters for the layer-skip drafter are not built: use --drafter {EARLY_EXIT} or a "
                               "draft model")
    if exit_layer is not None and drafter != EARLY_EXIT:
        raise click.UsageError(f"--exit-layer is for --drafter {EARLY_EXIT}")
    cfg = DistillConfig(divergence=divergence, jsd_beta=jsd_beta, data_source=data_source, steps=steps, lr=lr,
                        batch_size=batch_size, exit_layer=exit_layer, new_tokens=new_tokens,
                        prompts_per_domain=prompts_per_domain, refresh_every=refresh_every, eval_every=eval_every,
                        checkpoint_every=min(eval_every, 25), seed=seed)
    domains = domain_prompts(data, "--data")
    profile = load_profile(profile_dir)
    spec, dt, _, engine = profile_model(profile, model_spec, dtype)  # distillation trains on dense weights
    if engine != "torch":
        raise click.UsageError(f"the profile was calibrated on the {engine} engine; distillation trains through the "
                               "torch engine's layers: calibrate with --engine torch first")
    lm = load(spec, device, dt, "dense", engine="torch")
    profile.check_model(lm.fingerprint())
    draft_lm = None if drafter == EARLY_EXIT else load(drafter, device, "float32", "dense", engine="torch")
    r = distill(lm, profile_dir, domains, cfg, draft_lm=draft_lm, resume=resume, progress=not quiet and not as_json,
                plot=plot, log=(lambda m: None) if as_json else info)
    d = r.to_dict()
    if as_json:
        echo_json(d)
        return
    b, a = d["before"], d["after"]
    click.echo(f"{d['kind']} ({cfg.divergence}, {cfg.data_source}, {cfg.steps} steps, {d['train_seconds']:.0f} s of "
               f"training, {d['seconds']:.0f} s in all)")
    click.echo(f"  held-out greedy agreement   {b['greedy']:.3f} -> {a['greedy']:.3f}")
    click.echo(f"  held-out sampling acceptance {b['sampling']:.3f} -> {a['sampling']:.3f}")
    click.echo(f"  draft cost per token: {d['draft_cost']:.2f} of a full step")
    curves = f"; curves: {d['plot']}" if d["plot"] else "; no curves (matplotlib missing)"
    click.echo(f"stored in {d['profile']}{curves}")
