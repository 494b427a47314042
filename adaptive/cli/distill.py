"""``adaptive distill``: train a drafter towards the target (DistillSpec) and store it in a profile."""

from __future__ import annotations

import warnings

import click

from adaptive.cli.common import (
    LayerList,
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
from adaptive.costs import CpuWatch, busy_warning
from adaptive.distill.data import DATA_SOURCES
from adaptive.distill.divergences import DIVERGENCES
from adaptive.distill.heads import HeadConfig
from adaptive.distill.trainer import DistillConfig, distill, distill_head
from adaptive.profile import TRAINING_ENGINE, is_two_engine, load_profile, training_member

EARLY_EXIT, EAGLE = "early-exit", "eagle"


@command("distill", examples=(
    "adaptive distill --profile my-profile",
    "adaptive distill --profile my-profile --drafter early-exit --data code.jsonl --data maths=maths.txt "
    "--divergence tvd --steps 600",
    "adaptive distill --profile my-profile --drafter draft-model.gguf --data-source on-policy",
    "adaptive distill --profile my-profile --resume",
    "adaptive distill --profile my-profile --drafter eagle --data code.jsonl --data maths.txt --minutes 8",
), hints={"--domains": "distill takes its prompts with --data [NAME=]PATH"})
@model_option
@click.option("--profile", "profile_dir", required=True, type=click.Path(),
              help="The profile to train for; the drafter is stored in it (atomically).")
@click.option("--drafter", default=EAGLE, show_default=True, metavar="eagle|early-exit|MODEL",
              help="eagle: a head over the target's hidden states (trained on the target's own continuations, with "
                   "soft targets); early-exit: the first --exit-layer layers plus a trained exit block (measured at "
                   "0.99-1.00x: docs/history/2026-11-22-distillation.md); or a separate draft model (a spec as for "
                   "--model) sharing the target's tokenizer, fine-tuned whole.")
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
@click.option("--steps", type=int, default=None,
              help="Optimiser steps (0: store the untrained drafter) [300; eagle: as many as fit in --minutes].")
@click.option("--minutes", type=float, default=HeadConfig.minutes, show_default=True,
              help="eagle: the training budget (the decoding of its data comes first, apart).")
@click.option("--layers", "feature_layers", type=LayerList(), default=None, metavar="K,K,...",
              help="eagle: the feature layers, as layer counts (0: the embeddings; the top one included) "
                   "[half and all of the model's layers].")
@click.option("--vocab", type=int, default=HeadConfig.vocab, show_default=True,
              help="eagle: the head's rows (the training text's most frequent tokens; a request adds its prompt's).")
@click.option("--head-width", type=click.IntRange(min=1), default=None, metavar="N",
              help="eagle: the width of the head's MLP [the target's]; a narrower head trains more steps a minute "
                   "where the target's MLP is wide (Qwen2.5-1.5B: 8960).")
@click.option("--unroll", type=int, default=HeadConfig.unroll, show_default=True,
              help="eagle: unrolled draft steps trained (EAGLE-3's training-time test).")
@click.option("--race/--no-race", default=True, show_default=True,
              help="eagle: race the head against plain decoding in each calibrated domain of the same name, on its "
                   "held-out prompts, and let it decode the domains where it measures fastest.")
@click.option("--lr", type=float, default=None, help="AdamW learning rate [1e-3; eagle: 3e-3].")
@click.option("--batch-size", type=int, default=None,
              help="Token positions per step (early-exit) [64], sequences per step (draft model) [64] or windows of "
                   "256 positions per step (eagle) [4].")
@click.option("--new-tokens", type=int, default=None,
              help="Tokens generated per prompt for the data [48; eagle: 96].")
@click.option("--samples", type=int, default=HeadConfig.samples, show_default=True,
              help="eagle: continuations decoded per training prompt, the first greedy, the others sampled at "
                   "--temperature (more of the target's text per prompt).")
@click.option("--temperature", type=float, default=HeadConfig.temperature, show_default=True,
              help="eagle: the temperature of the sampled continuations (--samples 2 or more).")
@click.option("--prompts-per-domain", type=int, default=None,
              help="First N prompts of each domain [16; eagle: all]; the last quarter of them (eagle: a tenth) is "
                   "held out for evaluation.")
@click.option("--refresh-every", type=int, default=100, show_default=True,
              help="Steps between resamplings of on-policy data from the drafter being trained.")
@click.option("--eval-every", type=int, default=None, help="Steps between held-out evaluations [25; eagle: 100].")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Where to save the loss and acceptance curves (PNG) [PROFILE.KIND-distill.png].")
@click.option("--resume", is_flag=True, help="Continue an interrupted distillation from its last checkpoint.")
@click.option("--seed", type=int, default=0, show_default=True)
@dtype_option
@device_option
@quiet_option
@json_option
def distill_cmd(model_spec, profile_dir, drafter, exit_layer, data, divergence, jsd_beta, data_source, steps, minutes,
                feature_layers, vocab, head_width, unroll, race, lr, batch_size, new_tokens, samples, temperature,
                prompts_per_domain, refresh_every, eval_every, plot, resume, seed, dtype, device, quiet, as_json):
    """Distill a drafter for the profile's model and store it in the profile.

    early-exit: the target's first --exit-layer layers plus a trained exit block; eagle: a head
    over the target's own hidden states and a lookup token, trained on the target's continuations
    of the prompts on the profile's engine (a two-engine profile: its torch member; PAIR/llama.cpp for
    a head on llama.cpp; docs/design.md, "Eagle heads"); MODEL: a separate draft model sharing the
    target's tokenizer, fine-tuned whole. The drafter is then used by `adaptive generate --profile
    DIR --policy early-exit|eagle|draft-model` and `adaptive bench`.
    """
    if drafter == "skip":
        raise click.UsageError(f"adapters for the layer-skip drafter are not built: use --drafter {EARLY_EXIT} or a "
                               "draft model")
    if exit_layer is not None and drafter != EARLY_EXIT:
        raise click.UsageError(f"--exit-layer is for --drafter {EARLY_EXIT}")
    base = DistillConfig()  # the early-exit and draft-model options' defaults
    if drafter == EAGLE and (divergence != base.divergence or jsd_beta != base.jsd_beta
                             or data_source != base.data_source or refresh_every != base.refresh_every):
        raise click.UsageError(f"--divergence, --jsd-beta, --data-source and --refresh-every are for --drafter "
                               f"{EARLY_EXIT} or a draft model (the eagle head trains on the target's continuations)")
    if drafter != EAGLE and (samples != HeadConfig.samples or temperature != HeadConfig.temperature
                             or head_width is not None):
        raise click.UsageError(f"--samples, --temperature and --head-width are for --drafter {EAGLE}")
    if is_two_engine(profile_dir):  # `adaptive calibrate`'s default: the drafter goes where it is trained and drafts
        member = training_member(profile_dir)
        info(f"{profile_dir} is a two-engine profile: training into its {TRAINING_ENGINE} member, {member}")
        profile_dir = str(member)
    if drafter == EAGLE:
        return _distill_eagle(model_spec, profile_dir, data, steps, minutes, feature_layers, vocab, head_width, unroll,
                              race, lr, batch_size, new_tokens, samples, temperature, prompts_per_domain, eval_every,
                              plot, resume, seed, dtype, device, quiet, as_json)
    d = DistillConfig()  # the options the eagle head defaults otherwise take DistillConfig's defaults
    eval_every = eval_every or d.eval_every
    cfg = DistillConfig(divergence=divergence, jsd_beta=jsd_beta, data_source=data_source,
                        steps=d.steps if steps is None else steps, lr=lr or d.lr, batch_size=batch_size or d.batch_size,
                        exit_layer=exit_layer, new_tokens=new_tokens or d.new_tokens,
                        prompts_per_domain=prompts_per_domain or d.prompts_per_domain, refresh_every=refresh_every,
                        eval_every=eval_every, checkpoint_every=min(eval_every, d.checkpoint_every), seed=seed)
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


def _distill_eagle(model_spec, profile_dir, data, steps, minutes, feature_layers, vocab, head_width, unroll, race, lr,
                   batch_size, new_tokens, samples, temperature, prompts_per_domain, eval_every, plot, resume, seed,
                   dtype, device, quiet, as_json):
    d = HeadConfig()
    cfg = HeadConfig(layers=feature_layers or None, vocab=vocab, intermediate=head_width, minutes=minutes,
                     steps=steps, unroll=unroll,
                     lr=lr or d.lr, batch=batch_size or d.batch, new_tokens=new_tokens or d.new_tokens,
                     samples=samples, temperature=temperature,
                     prompts_per_domain=prompts_per_domain, eval_every=eval_every or d.eval_every, seed=seed)
    domains = domain_prompts(data, "--data")
    profile = load_profile(profile_dir)
    spec, dt, _, engine = profile_model(profile, model_spec, dtype)
    # the head trains on the features of the engine it drafts on (llama.cpp's: its layer inputs and output rows)
    lm = load(spec, device, dt, "dense", engine="torch") if engine == "torch" else load(spec, device, "auto",
                                                                                        engine=engine)
    profile.check_model(lm.fingerprint())
    r = train_head_watched(lm, profile_dir, domains, cfg, resume=resume, progress=not quiet and not as_json,
                           plot=plot, race=race, log=(lambda m: None) if as_json else info)
    d = r.to_dict()
    if as_json:
        echo_json(d)
        return
    rec = r.record
    click.echo(f"eagle head ({len(rec.positions)} draft positions, {rec.train_seconds:.0f} s of training, "
               f"{rec.seconds:.0f} s in all; {rec.vocab} rows covering {rec.coverage:.1%} of held-out answer tokens)")
    click.echo(f"  held-out first draft kept  {rec.before['greedy']:.3f} -> {rec.kept_text()} "
               f"(90% interval over {rec.eval_prompts} held-out answers)")
    click.echo("  drafts 1..s all kept       " + "  ".join(f"s={i + 1}: {a:.3f}" for i, a in enumerate(rec.positions))
               + f"  (tau {rec.tau:.2f})")
    for name, acc in sorted(rec.by_domain.items()):
        iv = rec.domain_intervals.get(name)
        click.echo(f"    {name:<20} " + "  ".join(f"{a:.3f}" for a in acc)
                   + (f"  (first draft {iv.to_text(3)})" if iv is not None else ""))
    click.echo(f"  draft cost per token: {rec.draft_cost:.3f} of a full step")
    curves = f"; curves: {d['plot']}" if d["plot"] else "; no curves (matplotlib missing)"
    click.echo(f"stored in {d['profile']}{curves}")


def train_head_watched(lm, path, domains: dict[str, list[str]], cfg: HeadConfig, **kwargs):
    """:func:`distill_head`, watched: where other work used the machine meanwhile
    (:func:`~adaptive.costs.busy_warning`), a one-line warning, since its steps then come slower (a minutes
    budget buys fewer of them) and the head's race against ``ar`` reads slow."""
    with CpuWatch() as watch:
        r = distill_head(lm, path, domains, cfg, **kwargs)
    warning = busy_warning("the eagle head's training and race", watch.others_share)
    if warning:
        warnings.warn(warning, stacklevel=2)
    return r
