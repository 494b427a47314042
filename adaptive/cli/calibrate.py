"""``adaptive calibrate``, ``adaptive profile show`` and ``adaptive route``."""

from __future__ import annotations

import click

from adaptive.cli.common import device_option, dtype_option, echo_json, json_option, model_option


def _fmt(v, nd=3):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def summary_table(profile) -> str:
    """The end-of-calibration table: one row per domain, then the global set."""
    head = ["domain", "prompts", "anchors", "attn", "mlp", "k", "est.acc", "meas.acc", "est.x", "meas.x", "vocab",
            "pld.x", "casc.x", "decode"]
    rows = [[r["domain"], r["prompts"], r["anchors"], r["skip_attn"], r["skip_mlp"], r["draft_len"],
             _fmt(r["est_acceptance"], 2), _fmt(r["meas_acceptance"], 2), _fmt(r["est_speedup"], 2),
             _fmt(r["meas_speedup"], 2), r.get("draft_vocab") or "full", _fmt(r.get("pld_speedup"), 2), _fmt(r.get("cascade_speedup"), 2), r["decision"]]
            for r in profile.summary_rows()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


@click.command("calibrate")
@model_option
@click.option("--domains", "domain_args", multiple=True, metavar="NAME=PATH",
              help="A domain's prompts (JSONL with prompt/turns/text, or .txt); repeatable. Default: the built-in domains.")
@click.option("--out", "out_dir", default="adaptive-profile", show_default=True, type=click.Path(file_okay=False),
              help="Profile directory to write (atomically).")
@click.option("--quick", is_flag=True, help="Fewer prompts, trials and tokens: a few minutes on 2 CPU cores.")
@click.option("--prompts-per-domain", type=int, default=None, help="Prompts used per domain (first N) [16; quick 6].")
@click.option("--anchors-per-domain", type=int, default=None, help="FAISS k-means anchors per domain [10; quick 6].")
@click.option("--trials", type=int, default=None, help="Bayesian-search trials per domain [30; quick 10].")
@click.option("--space", type=click.Choice(["ranked", "sublayer"]), default="ranked", show_default=True,
              help="Search space: ranked sublayer counts, or Self-SD's one variable per sublayer.")
@click.option("--jobs", type=int, default=1, show_default=True, help="Domains searched in parallel.")
@click.option("--backend", type=click.Choice(["loky", "threading", "dask", "ray"]), default="loky", show_default=True,
              help="joblib backend for --jobs > 1 (dask/ray: an existing cluster, or a local one).")
@click.option("--scheduler", default=None, help="dask scheduler (or ray) address, e.g. tcp://host:8786.")
@click.option("--vocab-sizes", default=None, metavar="LIST",
              help="Reduced draft-vocabulary sizes to try, e.g. 2048,4096 ('none': full head only) "
                   "[1024,2048,4096,8192,16384].")
@click.option("--resume", is_flag=True, help="Continue an interrupted calibration of the same --out.")
@click.option("--seed", type=int, default=0, show_default=True)
@dtype_option
@device_option
@click.option("--quiet", is_flag=True, help="No progress bars.")
@json_option
def calibrate_cmd(model_spec, domain_args, out_dir, quick, prompts_per_domain, anchors_per_domain, trials, space,
                  jobs, backend, scheduler, vocab_sizes, resume, seed, dtype, device, quiet, as_json):
    """Find the best skip set per domain and write a profile directory."""
    from adaptive.calibrate.runner import CalibrationSettings, calibrate
    from adaptive.calibrate.sources import load_domains

    over = {k: v for k, v in dict(prompts_per_domain=prompts_per_domain, anchors_per_domain=anchors_per_domain,
                                  trials=trials).items() if v is not None}
    over.update(space=space, seed=seed)
    if vocab_sizes is not None:
        try:
            over["vocab_sizes"] = () if vocab_sizes.strip().lower() == "none" else tuple(
                int(v) for v in vocab_sizes.split(",") if v.strip())
        except ValueError:
            raise click.BadParameter(f"not a comma-separated list of integers: {vocab_sizes!r}",
                                     param_hint="--vocab-sizes") from None
    if trials is not None:
        base = CalibrationSettings.quick() if quick else CalibrationSettings()
        over["init_trials"] = min(base.init_trials, trials)
    settings = CalibrationSettings.quick(**over) if quick else CalibrationSettings(**over)
    domains = load_domains(domain_args)
    log = (lambda m: click.echo(m, err=True))
    profile = calibrate(model_spec, domains, out_dir, settings, jobs=jobs, backend=backend, scheduler=scheduler,
                        resume=resume, device=device, dtype=dtype, progress=not quiet, log=log)
    if as_json:
        echo_json({"profile": str(profile.path), **profile.to_dict()})
        return
    click.echo(summary_table(profile))
    click.echo(f"\nprofile written to {profile.path} ({profile.settings.get('seconds')} s)")


@click.group("profile")
def profile_group():
    """Inspect calibration profiles."""


@profile_group.command("show")
@click.argument("directory", type=click.Path())
@json_option
def profile_show(directory, as_json):
    """Print a profile: model, settings, and per-domain skip sets with their measurements."""
    from adaptive.profile import load_profile

    p = load_profile(directory)
    if as_json:
        echo_json({"profile": str(p.path), **p.to_dict()})
        return
    m = p.model
    click.echo(f"profile {p.path} (schema 1, adaptive {p.version}, created {p.created})")
    click.echo(f"model   {m.get('name')} ({m.get('model_type')}, {m.get('n_layers')} layers, {m.get('dtype')}; "
               f"config {m.get('config_hash')}, weights {m.get('weights_hash')})")
    c = p.cost_model
    click.echo(f"costs   attention {sum(c.attn):.2f}, MLP {sum(c.mlp):.2f}, rest {c.base:.2f} of a "
               f"{c.step_ms:.1f} ms step; verify 1/5/9 tokens {c.verify_cost(0):.2f}/{c.verify_cost(4):.2f}/{c.verify_cost(8):.2f}")
    click.echo(f"routing {len(p.index.labels)} anchors, k={p.index.k}, out-of-domain beyond {p.index.ood_threshold:.3f}")
    s = p.settings
    click.echo(f"search  {s.get('space')} space, {s.get('trials')} trials, seed {s.get('seed')}, {s.get('seconds')} s\n")
    click.echo(summary_table(p))
    click.echo("\nskip sets:")
    for r in p.summary_rows():
        click.echo(f"  {r['domain']}: {r['skip']}")
    for kind, meta in sorted(p.distilled.items()):
        b, a, c = meta["before"], meta["after"], meta["config"]
        what = f"exit after layer {meta['exit_layer']}" if kind == "early-exit" else f"model {meta.get('name')}"
        click.echo(f"\ndistilled {kind} ({what}; {c['divergence']}, {c['data_source']}, {c['steps']} steps): held-out "
                   f"greedy agreement {b['greedy']:.3f} -> {a['greedy']:.3f}, sampling acceptance "
                   f"{b['sampling']:.3f} -> {a['sampling']:.3f}, draft cost {meta['draft_cost']:.2f} of a step")


@click.command("route")
@click.argument("prompt", required=False)
@click.option("--profile", "profile_dir", required=True, type=click.Path(), help="Profile directory.")
@click.option("--data", "data_file", type=click.Path(), default=None, help="Prompt file (JSONL or .txt) instead of PROMPT.")
@click.option("--k", "k", type=int, default=None, help="Neighbours that vote (default: the profile's).")
@model_option
@dtype_option
@device_option
@json_option
def route_cmd(prompt, profile_dir, data_file, k, model_spec, dtype, device, as_json):
    """Show the domain, skip set and nearest anchors a prompt is routed to."""
    from adaptive.calibrate.sources import read_prompt_rows
    from adaptive.cli.common import load, profile_model
    from adaptive.engine.engine import Engine
    from adaptive.index.router import route_prompt
    from adaptive.profile import load_profile

    if (prompt is None) == (data_file is None):
        raise click.UsageError("give either PROMPT or --data FILE")
    if k is not None and k < 1:
        raise click.BadParameter("must be >= 1", param_hint="--k")
    p = load_profile(profile_dir)
    spec, dt = profile_model(p, model_spec, dtype)
    lm = load(spec, device, dt)
    p.check_model(lm.fingerprint())
    engine = Engine(lm)
    rows = read_prompt_rows(data_file) if data_file else [{"prompt": prompt}]
    for row in rows:
        d = route_prompt(p, engine, row["prompt"], k)
        if as_json:
            extra = {"category": row["category"]} if "category" in row else {}
            echo_json({"domain": d.route.domain, **extra, **d.to_dict(), "prompt": row["prompt"][:200]})
            continue
        where = "out-of-domain: global set" if d.route.out_of_domain else f"domain {d.route.domain}"
        click.echo(f"{row['prompt'][:70]!r}")
        how = f"skip {d.skip_text}, " if d.method == "ssd" else ""
        click.echo(f"  -> {where}; decode with {d.method} ({how}draft length {d.draft_len})")
        click.echo("  nearest: " + ", ".join(f"{dom} {dist:.3f}" for dom, dist in d.route.neighbours))
