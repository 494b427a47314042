"""``adaptive demo``: the README's main job on the embedded default model.

1. Calibrate on the built-in domains with the quick preset (or reuse the profile already at
   ``--profile`` when it was made for this model), and print the profile summary.
2. Route a built-in prompt that calibration did not use, decode it with plain decoding (``ar``)
   and with the runtime (``AdaptiveRuntime``: the profile's choice for that domain, bandit draft
   lengths), interleaved, and print the speedup.
3. Where both engines run the model (a GGUF model on a CPU with llama-cpp-python: a two-engine
   profile), a short and a long prompt through the two-engine runtime: the engine each ran on,
   the expected times that chose it, and the measured time against plain decoding on each engine.
4. On a CPU with a torch profile (a two-engine profile's torch member), a short eagle head
   (``--head-minutes``; trained once, kept in the profile): its held-out acceptance, its race in each
   domain, and the demo prompt decoded with it on the torch engine against plain decoding there.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import click

from adaptive.calibrate.prompts import builtin_domains
from adaptive.calibrate.runner import CalibrationSettings, calibrate, calibrate_engines
from adaptive.cli.calibrate import summary_table
from adaptive.cli.common import (
    command,
    device_option,
    dtype_option,
    echo_json,
    engine_option,
    info,
    json_option,
    load,
    model_option,
    profile_model,
    quiet_option,
)
from adaptive.distill.heads import HeadConfig
from adaptive.distill.trainer import distill_head
from adaptive.drafters.factory import DrafterSpec, build_drafter
from adaptive.engine.audit import audit_divergence
from adaptive.engine.config import GenerationConfig
from adaptive.engine.engine import Engine
from adaptive.models import auto_engines
from adaptive.profile import Interval, ProfileError, is_two_engine, load_profile, member_dir, read_engines
from adaptive.runtime import AdaptiveRuntime

DEMO_DOMAIN = "math"
DEMO_PROMPT_INDEX = -1  # the last built-in maths prompt: never among the first N calibration uses
DEMO_HEAD_MINUTES = 2.0
# the demo's head: 48 tokens of 12 prompts a domain decoded (about a minute on 2 cores), then its minutes
DEMO_HEAD = dict(new_tokens=48, prompts_per_domain=12)


@command("demo", examples=(
    "adaptive demo",
    "adaptive demo --recalibrate --max-new-tokens 128 --repeats 5",
    "adaptive demo --profile my-profile --json",
))
@model_option
@click.option("--profile", "profile_dir", default="adaptive-profile", show_default=True,
              type=click.Path(file_okay=False),
              help="Profile to reuse, or to write with a quick calibration when absent.")
@click.option("--recalibrate", is_flag=True, help="Calibrate even when --profile already holds a profile.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed runs per method (median).")
@click.option("--head-minutes", type=click.FloatRange(min=0), default=DEMO_HEAD_MINUTES, show_default=True,
              help="Train a short eagle head on the torch engine for this long (0: none), once per profile.")
@dtype_option
@engine_option
@device_option
@quiet_option
@json_option
def demo_cmd(model_spec, profile_dir, recalibrate, max_new_tokens, repeats, head_minutes, dtype, engine, device,
             quiet, as_json):
    """Calibrate on the built-in domains (quick), then route and decode a prompt and print the speedup."""
    engines = auto_engines(model_spec, device, dtype) if engine == "auto" else (engine,)
    lm = load(model_spec, device, dtype, engine=engines[0])
    profile = None
    if recalibrate and ((Path(profile_dir) / "profile.json").exists() or is_two_engine(profile_dir)):
        shutil.rmtree(profile_dir)  # a profile (one or two engines) this command is asked to redo
    if is_two_engine(profile_dir):
        profile = load_profile(profile_dir, engines[0])
        try:
            profile.check_model(lm.fingerprint())
        except ProfileError as exc:
            raise ProfileError(f"{exc}; pass --recalibrate to replace it") from None
        info(f"reusing the two-engine profile in {profile_dir} (--recalibrate to redo it)")
    elif (Path(profile_dir) / "profile.json").exists():
        profile = load_profile(profile_dir)
        try:
            profile.check_model(lm.fingerprint())
        except ProfileError as exc:
            raise ProfileError(f"{exc}; pass --recalibrate to replace it") from None
        info(f"reusing the profile in {profile_dir} (--recalibrate to redo it)")
    if profile is None:
        domains = builtin_domains()
        click.echo(f"calibrating on {len(domains)} built-in domains (quick preset) ...", err=True)
        log = lambda m: click.echo(m, err=True)  # noqa: E731
        if len(engines) > 1:
            profile = calibrate_engines({e: lm if e == engines[0] else model_spec for e in engines}, domains,
                                        profile_dir, CalibrationSettings.quick(), device=device, dtype=dtype,
                                        progress=not quiet, log=log)[engines[0]]
        else:
            profile = calibrate(lm, domains, profile_dir, CalibrationSettings.quick(), device=device, dtype=dtype,
                                progress=not quiet, log=log)
    engine = Engine(lm)
    # timed with repeats of one prompt: nothing learned from them, no prefix kept between them
    runtime = AdaptiveRuntime(profile, lm, online=False, prefix_cache=0)
    prompt = builtin_domains()[DEMO_DOMAIN][DEMO_PROMPT_INDEX]
    decision = runtime.route(prompt)
    applied = profile.domain(decision.route.domain)
    best = applied.layer_skip  # the domain's best skip set, whatever it decodes with
    engine.generate(prompt, GenerationConfig(max_new_tokens=8))  # warm-up
    runs = {"ar": lambda: engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens)),
            "routed": lambda: runtime.generate(prompt, max_new_tokens=max_new_tokens)}
    if decision.drafter != "ssd" and best.skip:  # show what the domain's skip set would have done anyway
        ssd = build_drafter(DrafterSpec("ssd", skip=best.skip), lm.backbone)
        ssd_cfg = GenerationConfig(max_new_tokens=max_new_tokens, draft_len=best.draft_len)
        runs["ssd"] = lambda: engine.generate(prompt, ssd_cfg, drafter=ssd)
    methods = list(runs)
    med, results = interleaved(runs, repeats)
    ids = engine.encode(prompt)
    audits = {m: audit_divergence(lm.backbone, ids, results["ar"].token_ids, results[m].token_ids)
              for m in methods if m != "ar"}
    out = {
        "model": lm.name, "engine": lm.engine, "dtype": lm.dtype_name, "profile": str(profile.path),
        "summary": profile.summary_rows(), "prompt": prompt, "route": decision.to_dict(),
        "tokens_per_s": {m: round(v, 2) for m, v in med.items()},
        "speedup": {m: round(med[m] / med["ar"], 3) for m in methods if m != "ar"},
        "identical": {m: a.identical for m, a in audits.items()},
        "lossless_violations": sum(a.violation for a in audits.values()),
        "acceptance_rate": {m: round(results[m].stats.acceptance_rate, 3) for m in methods if m != "ar"},
        "text": results["routed"].text,
    }
    if is_two_engine(profile_dir):
        out["engines"] = engine_choices(profile_dir, runtime, model_spec, device, max_new_tokens, repeats)
        out["lossless_violations"] += sum(row["audit"]["violation"] for row in out["engines"])
    torch_path = _torch_profile(profile_dir, lm)
    if head_minutes > 0 and torch_path is not None and device in ("auto", "cpu"):
        cfg = HeadConfig(minutes=head_minutes, **DEMO_HEAD)
        out["head"] = head_demo(torch_path, model_spec, device, cfg, builtin_domains(), prompt, max_new_tokens, repeats,
                                quiet)
        out["lossless_violations"] += out["head"]["audit"]["violation"]
    if as_json:
        echo_json(out)
        return
    click.echo(summary_table(profile) + "\n")
    click.echo(f"prompt ({DEMO_DOMAIN}, not used for calibration): {prompt}\n")
    click.echo(results["routed"].text.strip() + "\n")
    where = "out-of-domain: global set" if decision.route.out_of_domain else f"domain {decision.route.domain}"
    skip_text = best.skip.to_text()
    if not lm.backbone.layer_skip:
        skip_note = f"the {lm.engine} engine runs the whole model: no layer skipping there"
    elif best.skip:
        skip_note = f"best skip set {skip_text}"
    elif best.bound is not None and not best.may_pay:
        skip_note = (f"layer skipping cannot pay there: at most {best.bound:.2f}x against the statistical "
                     f"drafters' {best.reference:.2f}x")
    else:
        skip_note = "no skip set above the acceptance floor"
    chosen = [m for m in applied.measurements if m.drafter == decision.drafter and m.verdict == "faster"]
    measured = (f"{applied.decision.speedup:.2f}x, interval {chosen[0].interval.to_text()}"
                if chosen and chosen[0].interval else f"{applied.decision.speedup:.2f}x")
    how = {"ssd": f" (skip {skip_text}, draft length {best.draft_len}; it measured fastest, {measured})",
           "pld": f" (prompt lookup, draft length {profile.runtime.pld_draft_len}: it measured fastest, {measured}; "
                  f"{skip_note})",
           "cascade": (" (the cascade: prompt lookup and the domain's bigram table"
                       + (f" after {applied.cascade.split} layer-skip position(s)" if applied.cascade.split else "")
                       + f"; it measured fastest, {measured} at calibration; {skip_note})"),
           "ar": f" (no drafter measured faster than plain decoding there; {skip_note})"}
    click.echo(f"routed to {where}; the profile decodes it with {decision.drafter}" + how.get(decision.drafter, ""))
    click.echo(f"model {out['model']} ({out['engine']} engine, {out['dtype']}), {max_new_tokens} new tokens, "
               f"median of {repeats} interleaved runs")
    click.echo(f"  ar     : {med['ar']:.1f} tok/s")
    for m in methods:
        if m == "ar":
            continue
        same = _audit_text(audits[m].to_dict(), "ar")
        label = "routed" if m == "routed" else "ssd*"
        click.echo(f"  {label:7s}: {med[m]:.1f} tok/s, speedup {med[m] / med['ar']:.2f}x, "
                   f"acceptance {results[m].stats.acceptance_rate:.2f}, {same}")
    if "ssd" in methods:
        click.echo("  * ssd with the domain's best skip set, shown for comparison; the runtime would not use it")
    if "head" in out:
        click.echo("\n" + head_text(out["head"]))
    if "engines" in out:
        click.echo(f"\neach request on the engine expected to finish it first (two-engine profile; whole requests, "
                   f"prefill included, median of {repeats}):")
        for row in out["engines"]:
            plain = ", ".join(f"{e} {t:.2f} s" for e, t in row["plain_s"].items())
            click.echo(f"  {row['prompt']} prompt ({row['prompt_tokens']} tokens): ran on {row['engine']}, "
                       f"{row['reason']}; measured {row['measured_s']:.2f} s (plain decoding: {plain}); "
                       + _audit_text(row["audit"], "plain decoding there"))


def interleaved(runs: dict, repeats: int) -> tuple[dict[str, float], dict]:
    """Each of ``runs`` (name -> a call returning a generation result) ``repeats`` times, interleaved so
    that machine drift hits all alike: ``(median tok/s by name, the last result by name)``."""
    tps, results = {m: [] for m in runs}, {}
    for _ in range(repeats):
        for m, run in runs.items():
            results[m] = run()
            tps[m].append(results[m].stats.tokens_per_s)
    return {m: statistics.median(v) for m, v in tps.items()}, results


def _audit_text(audit: dict, reference: str) -> str:
    """How an output compares with ``reference``'s (an :class:`~adaptive.engine.audit.AuditResult`'s
    ``to_dict()``): identical, or where it parts and whether that is a near-tie or a violation."""
    if audit["identical"]:
        return f"identical to {reference}"
    margin = audit["margin"]
    margin = "" if margin is None or margin == float("inf") else f", margin {margin:.3f}"
    return (f"parts from {reference} at token {audit['position']}{margin}: "
            + ("LOSSLESS VIOLATION" if audit["violation"] else "a near-tie within the engine's rounding"))


LONG_PROMPT_TOKENS = 600  # the demo's long prompt: about as long as a Spec-Bench summarization or RAG prompt


def _long_prompt(encode, tokens: int = LONG_PROMPT_TOKENS) -> str:
    """A summarization request of about ``tokens`` tokens (a little more) made of built-in prompts,
    taken in turn from each domain."""
    head = "Summarize the following requests in three sentences:\n\n"
    pools = [list(prompts) for prompts in builtin_domains().values()]
    texts: list[str] = []
    while any(pools) and len(encode(head + "\n".join(texts))) < tokens:
        pool = next(p for p in pools[len(texts) % len(pools):] + pools if p)
        texts.append(pool.pop(0))
    return head + "\n".join(texts)


def engine_choices(profile_dir, primary: AdaptiveRuntime, model_spec: str, device: str, max_new_tokens: int,
                   repeats: int) -> list[dict]:
    """A short and a long prompt through the two-engine runtime: where each ran and why (expected
    times), its measured time against plain decoding on each engine, and whether its tokens are plain
    decoding's on the engine that ran it."""
    from adaptive.runtime.engines import TwoEngineRuntime

    members = read_engines(profile_dir)
    runtimes = {primary.lm.engine: primary}
    for e in members.engines:
        if e not in runtimes:
            p = load_profile(profile_dir, e)
            lm = load(model_spec, device, p.model.dtype or "auto", p.model.weights, engine=e)
            runtimes[e] = AdaptiveRuntime(p, lm, online=False, model_lock=primary.model_lock, prefix_cache=0)
    two = TwoEngineRuntime(runtimes, members.default)
    rows = []
    short = builtin_domains()[DEMO_DOMAIN][DEMO_PROMPT_INDEX]
    long = _long_prompt(primary.encode, min(LONG_PROMPT_TOKENS, two.room([]) // 3))  # a small model's context
    for label, prompt in (("short", short), ("long", long)):
        ids = two.encode(prompt)
        engines = {e: Engine(rt.lm) for e, rt in runtimes.items()}
        cfg = GenerationConfig(max_new_tokens=max_new_tokens)
        two.generate(prompt, max_new_tokens=4)  # warm-up
        times, plain, results, refs = [], {e: [] for e in engines}, None, {}
        for _ in range(repeats):  # interleaved
            results = two.generate(prompt, max_new_tokens=max_new_tokens)
            times.append(results.stats.total_time)
            for e, eng in engines.items():
                refs[e] = eng.generate(ids, cfg)
                plain[e].append(refs[e].stats.total_time)
        choice = results.engine_choice
        audit = audit_divergence(runtimes[results.engine].lm.backbone, ids, refs[results.engine].token_ids,
                                 results.token_ids)
        rows.append({"prompt": label, "prompt_tokens": len(ids), "engine": results.engine, "reason": choice["reason"],
                     "estimates": choice["estimates"], "measured_s": round(statistics.median(times), 3),
                     "plain_s": {e: round(statistics.median(v), 3) for e, v in plain.items()},
                     "identical": audit.identical, "audit": audit.to_dict()})
    return rows


def _torch_profile(profile_dir, lm) -> Path | None:
    """The torch profile a head trains into: a two-engine profile's torch member, or the profile itself
    when it was calibrated on the torch engine; ``None`` where there is none."""
    if is_two_engine(profile_dir):
        return member_dir(profile_dir, "torch") if "torch" in read_engines(profile_dir).engines else None
    return Path(profile_dir) if lm.engine == "torch" else None


def head_demo(path: Path, model_spec: str, device: str, cfg: HeadConfig, domains: dict[str, list[str]], prompt: str,
              max_new_tokens: int, repeats: int, quiet: bool) -> dict:
    """Train an eagle head (``cfg``) on ``domains`` into the torch profile at ``path`` unless it holds one
    (raced in every domain, :func:`~adaptive.distill.trainer.distill_head`), then decode ``prompt`` with
    it (policy ``eagle``) and with the profile's routing (``knn-ssd``) on the torch engine against plain
    decoding there, interleaved: tok/s, tokens per target forward, and the audit against plain decoding."""
    profile = load_profile(path)
    spec, dt, weights, _ = profile_model(profile, model_spec, "auto")
    trained = "eagle" not in profile.distilled
    if trained:
        before = _decisions(profile)
        click.echo(f"training an eagle head on the torch engine ({cfg.minutes:g} minutes after its data) ...", err=True)
        dense = load(spec, device, dt, "dense", engine="torch")
        say = (lambda m: None) if quiet else (lambda m: click.echo(m, err=True))
        distill_head(dense, path, domains, cfg, progress=False, log=say)  # its lines, not a bar: a short log
        del dense
        profile = load_profile(path)
    else:
        before = None
    rec = profile.distilled["eagle"]
    lm = load(spec, device, dt, weights, engine="torch")
    rt = AdaptiveRuntime(profile, lm, online=False, prefix_cache=0)
    engine = Engine(lm)
    ids = engine.encode(prompt)
    runs = {"ar": lambda: engine.generate(ids, GenerationConfig(max_new_tokens=max_new_tokens)),
            "eagle": lambda: rt.generate(prompt, max_new_tokens=max_new_tokens, policy="eagle"),
            "routed": lambda: rt.generate(prompt, max_new_tokens=max_new_tokens)}
    for run in runs.values():
        run()  # warm-up
    med, results = interleaved(runs, repeats)
    audits = {m: audit_divergence(lm.backbone, ids, results["ar"].token_ids, results[m].token_ids)
              for m in ("eagle", "routed")}
    return {"profile": str(path), "trained_now": trained, "minutes": rec.train_seconds / 60,
            "acceptance": rec.acceptance, "interval": [rec.interval.low, rec.interval.high] if rec.interval else [],
            "tau": rec.tau, "draft_cost": rec.draft_cost,
            "decisions": _decisions(profile), "before": before,
            "routed_decision": results["routed"].decision,
            "tokens_per_s": {m: round(v, 2) for m, v in med.items()},
            "speedup": {m: round(med[m] / med["ar"], 3) for m in ("eagle", "routed")},
            "tokens_per_forward": {m: round(results[m].stats.mean_accepted_tokens, 2) for m in ("eagle", "routed")},
            "audit": {"violation": sum(a.violation for a in audits.values())},
            "audits": {m: a.to_dict() for m, a in audits.items()}}


def _decisions(profile) -> dict[str, str]:
    """Each domain's decided drafter, and the global record's (out-of-domain requests) as ``(global)``."""
    out = {n: d.decision.drafter for n, d in profile.domains.items()}
    return {**out, "(global)": profile.global_set.decision.drafter}


def head_text(h: dict) -> str:
    """The head's part of the demo, as printed."""
    changed = [f"{n} {h['before'][n]} -> {d}" for n, d in sorted(h["decisions"].items())
               if h["before"] is not None and h["before"].get(n) != d]
    eagle = sorted(n for n, d in h["decisions"].items() if d == "eagle")
    lines = [f"an eagle head on the torch engine ({h['minutes']:.1f} min of training"
             + (", this run" if h["trained_now"] else ", kept in the profile") + f"): held-out first draft kept "
             f"{h['acceptance']:.2f}" + (f" {Interval(*h['interval']).to_text()}" if h.get("interval") else "")
             + f", tau {h['tau']:.2f} (3 drafts), a draft {h['draft_cost']:.3f} of a step",
             "  raced in each domain: " + ("; ".join(changed) if changed else
                                          "decisions unchanged" if h["before"] is not None else "(raced before)")
             + "; decoding with it: " + (", ".join(eagle) if eagle else "none"),
             f"  the maths prompt on the torch engine: ar {h['tokens_per_s']['ar']:.1f} tok/s"]
    for m in ("eagle", "routed"):
        label = "eagle (tree drafts)" if m == "eagle" else f"routed ({h['routed_decision']})"
        lines.append(f"  {label}: {h['tokens_per_s'][m]:.1f} tok/s, speedup {h['speedup'][m]:.2f}x, "
                     f"{h['tokens_per_forward'][m]:.2f} tokens per target forward, "
                     + _audit_text(h["audits"][m], "ar"))
    return "\n".join(lines)
