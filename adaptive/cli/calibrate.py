"""``adaptive calibrate``, ``adaptive profile show`` and ``adaptive route``."""

from __future__ import annotations

from pathlib import Path

import click

from adaptive.calibrate.runner import BACKENDS, CalibrationSettings, calibrate, calibrate_engines
from adaptive.calibrate.search import SPACES
from adaptive.calibrate.sources import read_prompt_rows
from adaptive.cli.common import (
    Command,
    NameEqualsPath,
    SizeList,
    command,
    device_option,
    domain_prompts,
    dtype_option,
    echo_json,
    engine_option,
    info,
    json_option,
    load,
    model_option,
    profile_model,
    quiet_option,
    weights_option,
)
from adaptive.cli.distill import train_head_watched
from adaptive.costs import is_busy
from adaptive.distill.heads import HeadConfig
from adaptive.distill.refine import refined_heads
from adaptive.drafters.factory import LAYER_SKIP_DRAFTERS
from adaptive.engine.engine import Engine
from adaptive.index.router import route_prompt
from adaptive.models import auto_engines
from adaptive.profile import (
    SCHEMA_VERSION,
    TRAINING_ENGINE,
    is_two_engine,
    load_profile,
    member_online_path,
    profile_json,
    read_engines,
)
from adaptive.profile.overlay import (
    load_replicas,
    merge_overlays,
    overlay_path,
    profile_digest,
    remove_overlay,
    replica_dir,
)

SUMMARY_COLUMNS = {  # header -> (summary_rows() key, decimals or None)
    "domain": ("domain", None), "prompts": ("prompts", None), "bound": ("bound", 2), "ref": ("reference", 2),
    "trials": ("trials", None), "attn": ("skip_attn", None), "mlp": ("skip_mlp", None), "k": ("draft_len", None),
    "est.acc": ("est_acceptance", 2), "meas.acc": ("meas_acceptance", 2), "est.x": ("est_speedup", 2),
    "ssd.x [90%]": ("ssd_timed", None), "vocab": ("draft_vocab", None), "pld.x [90%]": ("pld_timed", None),
    "casc.x [90%]": ("cascade_timed", None), "decode": ("decision", None),
}


def _fmt(v, nd):
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if nd is not None and isinstance(v, float) else str(v)


def summary_table(profile) -> str:
    """The end-of-calibration table (:meth:`adaptive.profile.Profile.summary_rows`): one row per
    domain, then the global record; ``vocab`` is ``full`` where the domain drafts with the full head."""
    rows = [[("full" if key == "draft_vocab" and r[key] is None else _fmt(r[key], nd))
             for key, nd in SUMMARY_COLUMNS.values()] for r in profile.summary_rows()]
    head = list(SUMMARY_COLUMNS)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


@command("calibrate", examples=(
    "adaptive calibrate --quick --out my-profile",
    "adaptive calibrate --domains code=code.jsonl --domains maths=maths.txt --out my-profile",
    "adaptive calibrate --domains code=code.jsonl --vocab-sizes 2048,4096 --jobs 2 --out my-profile",
    "adaptive calibrate --domains code=code.jsonl --out my-profile --resume",
))
@model_option
@click.option("--domains", "domain_args", multiple=True, type=NameEqualsPath(),
              help="A domain's prompts (JSONL with prompt/turns/text, or .txt); repeatable. "
                   "Default: the built-in domains.")
@click.option("--out", "out_dir", default="adaptive-profile", show_default=True, type=click.Path(file_okay=False),
              help="Profile directory to write (atomically).")
@click.option("--quick", is_flag=True, help="Fewer prompts, trials and tokens: a few minutes on 2 CPU cores.")
@click.option("--prompts-per-domain", type=int, default=None, help="Prompts used per domain (first N) [16; quick 6].")
@click.option("--anchors-per-domain", type=int, default=None, help="FAISS k-means anchors per domain [10; quick 6].")
@click.option("--trials", type=int, default=None, help="Bayesian-search trials per domain [30; quick 10].")
@click.option("--space", type=click.Choice(SPACES), default=SPACES[0], show_default=True,
              help="Search space: ranked sublayer counts, or Self-SD's one variable per sublayer.")
@click.option("--jobs", type=int, default=1, show_default=True, help="Domains searched in parallel.")
@click.option("--backend", type=click.Choice(BACKENDS), default=BACKENDS[0], show_default=True,
              help="joblib backend for --jobs > 1 (dask/ray: an existing cluster, or a local one).")
@click.option("--scheduler", "--address", "scheduler", default=None,
              help="An existing cluster: a dask scheduler's address (tcp://host:8786) or a Ray cluster's "
              "(ray://host:10001, or auto on a node of it); without it a local cluster of --jobs workers.")
@click.option("--vocab-sizes", type=SizeList(), default=None,
              help="Reduced draft-vocabulary sizes to try, e.g. 2048,4096 ('none': full head only) "
                   f"[{','.join(map(str, CalibrationSettings().vocab_sizes))}].")
@click.option("--heads", is_flag=True,
              help="Then train an eagle head on the domains' prompts (torch engine; a two-engine profile's torch "
                   "member) and race it in every domain, as `adaptive distill --drafter eagle` does: about 4 minutes "
                   "of decoding its data and --head-minutes of training on 2 CPU cores.")
@click.option("--head-minutes", type=float, default=HeadConfig.minutes, show_default=True,
              help="The eagle head's training budget (with --heads).")
@click.option("--resume", is_flag=True, help="Continue an interrupted calibration of the same --out.")
@click.option("--seed", type=int, default=0, show_default=True)
@dtype_option
@weights_option
@engine_option
@device_option
@quiet_option
@json_option
def calibrate_cmd(model_spec, domain_args, out_dir, quick, prompts_per_domain, anchors_per_domain, trials, space,
                  jobs, backend, scheduler, vocab_sizes, heads, head_minutes, resume, seed, dtype, weights, engine,
                  device, quiet, as_json):
    """Find the best drafter per domain and write a profile directory.

    Per domain: a Bayesian search of the best skip set, then prompt lookup, the cascade and a
    reduced draft vocabulary, all timed against plain decoding; the fastest is the domain's
    decision (see `adaptive profile show`). On the llama.cpp engine (no layer skipping) only
    prompt lookup and the cascade are raced. With --engine auto on a CPU where llama.cpp runs the
    model (a GGUF file, llama-cpp-python installed), both engines are calibrated into one
    two-engine profile (OUT/llama.cpp, OUT/torch): each request then runs on the engine expected
    to finish it first (llama.cpp decodes faster, torch prefills faster); --engine picks one.
    """
    over = {k: v for k, v in dict(prompts_per_domain=prompts_per_domain, anchors_per_domain=anchors_per_domain,
                                  trials=trials, vocab_sizes=vocab_sizes).items() if v is not None}
    over.update(space=space, seed=seed)
    if trials is not None:
        base = CalibrationSettings.quick() if quick else CalibrationSettings()
        over["init_trials"] = min(base.init_trials, trials)
    settings = CalibrationSettings.quick(**over) if quick else CalibrationSettings(**over)
    domains = domain_prompts(domain_args, "--domains")
    engines = auto_engines(model_spec, device, dtype, weights) if engine == "auto" else (engine,)
    if heads and TRAINING_ENGINE not in engines:
        raise click.UsageError("--heads trains a head over the torch engine's hidden states, and the head drafts "
                               "there: calibrate with --engine torch or auto")
    head_cfg = HeadConfig(minutes=head_minutes, seed=seed) if heads else None
    if len(engines) > 1:
        profiles = calibrate_engines({e: model_spec for e in engines}, domains, out_dir, settings, jobs=jobs,
                                     backend=backend, scheduler=scheduler, resume=resume, device=device, dtype=dtype,
                                     progress=not quiet, log=info, weights=weights)
        if head_cfg is not None:
            _train_head(profiles[TRAINING_ENGINE].path, model_spec, domains, head_cfg, dtype, device, quiet or as_json)
        seconds = sum(p.calibration.get("seconds") or 0 for p in profiles.values())
        if as_json:
            echo_json({"profile": str(out_dir), "engines": {e: {"profile": str(p.path), **profile_json(p)}
                                                            for e, p in profiles.items()}})
            return
        for e, p in profiles.items():
            click.echo(f"{e} engine:\n{summary_table(p)}\n")
        click.echo(f"two-engine profile written to {out_dir} ({round(seconds, 1)} s): each request runs on the "
                   f"engine expected to finish it first")
        return
    profile = calibrate(model_spec, domains, out_dir, settings, jobs=jobs, backend=backend, scheduler=scheduler,
                        resume=resume, device=device, dtype=dtype, progress=not quiet, log=info,
                        weights=weights, engine=engine)
    if head_cfg is not None:
        profile = _train_head(profile.path, model_spec, domains, head_cfg, dtype, device, quiet or as_json)
    if as_json:
        echo_json({"profile": str(profile.path), **profile_json(profile)})
        return
    click.echo(summary_table(profile))
    click.echo(f"\nprofile written to {profile.path} ({profile.calibration.get('seconds')} s)")


def _train_head(path, model_spec: str, domains: dict[str, list[str]], cfg: HeadConfig, dtype, device, quiet: bool):
    """Train and race an eagle head into the torch profile at ``path`` (:func:`distill_head`), on the model and
    dtype it was calibrated with (dense weights, as distillation trains); a line of its result on stderr.
    Returns the profile as written."""
    profile = load_profile(path)
    spec, dt, _, _ = profile_model(profile, model_spec, dtype)
    lm = load(spec, device, dt, "dense", engine="torch")
    info(f"training an eagle head into {path} ({cfg.minutes:g} minutes after its data) ...")
    r = train_head_watched(lm, path, domains, cfg, progress=not quiet, log=info)
    info(f"eagle head: held-out first draft kept {r.record.kept_text()}, tau {r.record.tau:.2f} "
         f"({r.record.seconds:.0f} s in all)")
    return load_profile(path)


@click.group("profile")
def profile_group():
    """Inspect calibration profiles."""


online_path_option = click.option(
    "--online-path", type=click.Path(dir_okay=False), default=None,
    help="The online overlay (what serving learned) [default: DIRECTORY.online, beside the profile].")


member_option = click.option(
    "--engine", "member", default=None,
    help="Of a two-engine profile, the member to use (llama.cpp or torch) [default: its default member].")


def profile_and_overlay(directory, online_path, member: str | None = None):
    """The profile at ``directory`` (a two-engine profile's ``member``) and where its online overlay is
    (``--online-path`` or beside it)."""
    p = load_profile(directory, member)
    if not online_path:
        return p, overlay_path(p.path)
    if is_two_engine(directory):  # the server kept each member's overlay apart: PATH.ENGINE
        return p, member_online_path(online_path, member or read_engines(directory).default)
    return p, Path(online_path)


@profile_group.command("show", cls=Command, examples=(
    "adaptive profile show my-profile",
    "adaptive profile show my-profile --json | jq '.domains.code.decision'",
))
@click.argument("directory", type=click.Path())
@online_path_option
@member_option
@json_option
def profile_show(directory, online_path, member, as_json):
    """Print a profile: model, costs, routing, and per domain its decision, skip set and measurements;
    then what serving learned online (the overlay beside it), if anything. A two-engine profile:
    its default member, or --engine's."""
    p, ov_path = profile_and_overlay(directory, online_path, member)
    members = read_engines(directory) if is_two_engine(directory) else None
    everyone = load_replicas(ov_path)  # every replica's, this calibration's or not
    digest = profile_digest(p.path)
    current = {r: ov for r, ov in everyone.items() if ov.profile == digest}
    stale = sorted(r for r in everyone if r not in current)
    online = None
    if everyone:
        merged = merge_overlays(current)
        online = {"path": str(ov_path), "replicas_dir": str(replica_dir(ov_path)), "stale": stale,
                  **merged.summary(), "replica": None,
                  "replicas": {r: ov.summary() for r, ov in sorted(everyone.items())}}
    heads = refined_heads(replica_dir(ov_path), digest)  # eagle heads refined on the traffic
    # each member's distilled drafters (a head trained by `calibrate --heads` is in the torch member's)
    shown = (member or members.default) if members is not None else None
    distilled = {e: sorted((p if e == shown else load_profile(directory, e)).distilled)
                 for e in members.engines} if members is not None else None
    if as_json:
        echo_json({"profile": str(p.path), **profile_json(p), "online": online, "refined_heads": heads,
                   **({"engines": {**members.to_dict(), "distilled": distilled}} if members is not None else {})})
        return
    m, c, s = p.model, p.cost_model, p.calibration
    if members is not None:
        others = [e for e in members.engines if e != shown]
        held = "".join(f"; its {e} member holds distilled {', '.join(distilled[e])}" for e in others if distilled[e])
        click.echo(f"two-engine profile {directory}: {', '.join(members.engines)} (default {members.default}); "
                   f"showing {shown} (--engine {others[0]} for the other){held}")
    click.echo(f"profile {p.path} (schema {SCHEMA_VERSION}, adaptive {p.version}, created {p.created})")
    click.echo(f"model   {m.name} ({m.model_type}, {m.n_layers} layers, {m.engine} engine, {m.dtype or 'GGUF'}, "
               f"{m.weights} weights; "
               f"config {m.config_hash}, weights {m.weights_hash})")
    busy = "" if c.others_share is None else f"; timed while other work used {c.others_share:.0%} of the CPU"
    if is_busy(c.others_share):
        busy += " (they read slow)"
    click.echo(f"costs   attention {sum(c.attn):.2f}, MLP {sum(c.mlp):.2f}, rest {c.base:.2f} of a "
               f"{c.step_ms:.1f} ms step; verify 1/5/9 tokens "
               + "/".join(f"{v:.2f}" for v in (c.verify_cost(0), c.verify_cost(4), c.verify_cost(8))) + busy)
    if c.prefill:
        click.echo("prefill " + ", ".join(f"{n} tokens {ms:.0f} ms" for n, ms in c.prefill)
                   + f"; expected {p.seconds_per_token() * 1e3:.1f} ms a new token over the domains")
    pool = p.index.pooling
    radii = (", ".join(f"{d} {t:.3f}" for d, t in sorted(p.index.ood_thresholds.items())) if p.index.ood_thresholds
             else f"{p.index.ood_threshold:.3f}")
    where = f"after {pool.layer} of {p.n_layers} layers" if pool.layer is not None else "after the last layer"
    click.echo(f"routing {len(p.index.labels)} anchors, k={p.index.k}, "
               f"out-of-domain beyond {radii}; prompts embedded by the "
               f"{'mean over positions' if pool.mode == 'mean' else 'last position'} {where}")
    click.echo(f"search  {s.get('space')} space, {s.get('trials')} trials, seed {p.settings.seed}, "
               f"{s.get('seconds')} s\n")
    click.echo(summary_table(p))
    click.echo("\nskip sets:")
    for r in p.summary_rows():
        click.echo(f"  {r['domain']}: {r['skip']}")
    for kind, d in sorted(p.distilled.items()):
        b, a, cfg = d.before, d.after, d.config
        if kind == "eagle":
            kept = " / ".join(f"{x:.3f}" for x in d.positions)
            click.echo(f"\ndistilled eagle (features after layers {','.join(map(str, d.shape['layers']))}; "
                       f"{d.vocab} rows, {d.train_seconds / 60:.1f} min of training): held-out first draft kept "
                       f"{b['greedy']:.3f} -> {d.kept_text()}, drafts 1..s kept {kept} (tau {d.tau:.2f}), "
                       f"draft cost {d.draft_cost:.3f} of a step")
            continue
        what = f"exit after layer {d.exit_layer}" if d.exit_layer is not None else f"model {d.name}"
        click.echo(f"\ndistilled {kind} ({what}; {cfg.get('divergence')}, {cfg.get('data_source')}, {cfg.get('steps')} "
                   f"steps): held-out greedy agreement {b['greedy']:.3f} -> {a['greedy']:.3f}, sampling acceptance "
                   f"{b['sampling']:.3f} -> {a['sampling']:.3f}, draft cost {d.draft_cost:.2f} of a step")
    click.echo("")
    for h in heads:
        if "error" in h:
            click.echo(f"refined head {h['file']}: unreadable ({h['error']})")
        else:
            click.echo(f"refined head of {h['domain']} (replica {h['replica']}, round {h['rounds']}, {h['created']}): "
                       f"held-out first draft kept {h['before']:.3f} -> {h['after']:.3f}"
                       + (" (STALE: refined for an earlier calibration of this profile; it is not loaded)"
                          if h["stale"] else ""))
    if online is None:
        click.echo(f"online  nothing learned yet (no overlay at {ov_path} or in {replica_dir(ov_path)})")
        return
    click.echo(f"online  {len(current)} replica(s) merged, last saved {online['saved']}: {online['requests']} "
               f"requests learned from")
    for r, part in online["replicas"].items():
        click.echo(f"  replica {r}: {part['requests']} requests, generation {part['generation']}, saved "
                   f"{part['saved']}, {part['buffered']} buffered, learned "
                   f"{', '.join(d['name'] for d in part['learned']) or 'none'}"
                   + (" (STALE: made for an earlier calibration of this profile; it is not applied)"
                      if r in stale else ""))
    for name, t in online["tables"].items():
        click.echo(f"  table {name}: {t['pairs']} pairs from {t['tokens']:.0f} accepted tokens")
    click.echo(f"  bandits saved: {len(online['bandits'])}; out-of-domain requests buffered: {online['buffered']}")
    for d in online["learned"]:
        click.echo(f"  learned domain {d['name']}: {d['members']} requests, {d['anchors']} anchors, "
                   f"decision {d['decision']} at {d['speedup']:.2f}x (measured {d['created']})")


@profile_group.command("reset-online", cls=Command, examples=(
    "adaptive profile reset-online my-profile",
    "adaptive profile reset-online my-profile --online-path /var/lib/adaptive/my-profile.online",
))
@click.argument("directory", type=click.Path())
@online_path_option
@member_option
def profile_reset_online(directory, online_path, member):
    """Forget what serving learned: remove the profile's online overlay, every replica's (the profile is
    untouched; of a two-engine profile, the default member's or --engine's). Stop servers using it
    first, or they save it again."""
    _, path = profile_and_overlay(directory, online_path, member)
    if remove_overlay(path):
        info(f"removed {path} and {replica_dir(path)}")
    else:
        info(f"nothing to remove: no overlay at {path} or in {replica_dir(path)}")


@command("route", examples=(
    'adaptive route --profile my-profile "Integrate x^2 from 0 to 3"',
    "adaptive route --profile my-profile --data held-out.jsonl --json",
    'adaptive route --profile my-profile --k 9 "def parse(s):"',
))
@click.argument("prompt", required=False)
@click.option("--profile", "profile_dir", required=True, type=click.Path(file_okay=False), help="Profile directory.")
@click.option("--data", "data_file", type=click.Path(dir_okay=False), default=None,
              help="Prompt file (JSONL or .txt) instead of PROMPT.")
@click.option("--k", "k", type=click.IntRange(min=1), default=None,
              help="Neighbours that vote (default: the profile's).")
@model_option
@dtype_option
@engine_option
@device_option
@json_option
def route_cmd(prompt, profile_dir, data_file, k, model_spec, dtype, engine, device, as_json):
    """Show the domain a prompt is routed to, what decodes it there, and the nearest anchors."""
    if (prompt is None) == (data_file is None):
        raise click.UsageError("give either PROMPT or --data FILE")
    p = load_profile(profile_dir)
    spec, dt, weights, eng = profile_model(p, model_spec, dtype, engine=engine)
    lm = load(spec, device, dt, weights, eng)
    p.check_model(lm.fingerprint())
    engine = Engine(lm)
    rows = read_prompt_rows(data_file) if data_file else [{"prompt": prompt}]
    for row in rows:
        r = route_prompt(p, engine, row["prompt"], k)
        if as_json:
            extra = {"category": row["category"]} if "category" in row else {}
            echo_json({"domain": r.route.domain, **extra, **r.to_dict(), "prompt": row["prompt"][:200]})
            continue
        where = "out-of-domain: global set" if r.route.out_of_domain else f"domain {r.route.domain}"
        how = f"skip {r.skip.to_text()}, " if r.drafter in LAYER_SKIP_DRAFTERS else ""
        click.echo(f"{row['prompt'][:70]!r}")
        click.echo(f"  -> {where}; decode with {r.drafter} ({how}draft length {r.draft_len})")
        click.echo("  nearest: " + ", ".join(f"{dom} {dist:.3f}" for dom, dist in r.route.neighbours))
