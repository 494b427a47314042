"""``adaptive bench``: Spec-Bench-style comparison of methods against plain decoding."""

from __future__ import annotations

import json
from pathlib import Path

import click

from adaptive.bench.data import ORDERS, SHARED_QUESTIONS, load_bench_prompts, mixed_stream
from adaptive.bench.report import markdown, plot
from adaptive.bench.runner import BENCH_METHODS, DISTILLED_KIND, BenchSettings, check_sampling, run_bench
from adaptive.cli.common import (
    NameList,
    command,
    device_option,
    dtype_option,
    engine_option,
    info,
    load,
    model_option,
    prefill_option,
    profile_model,
    quiet_option,
    weights_option,
)
from adaptive.profile import TRAINING_ENGINE, ProfileError, is_two_engine, load_profile, training_member

DEFAULT_METHODS = ("ar", "hf", "ssd-static", "knn-ssd")


@command("bench", examples=(
    "adaptive bench --data prompts.jsonl --methods ar,hf,pld",
    "adaptive bench --data builtin --profile adaptive-profile --skip-first 6 --per-category 3 --methods ar,knn-ssd",
    "adaptive bench --data spec_bench.jsonl --profile my-profile --methods ar,hf-pld,knn-ssd,cascade --skip-first 16",
    "adaptive bench --data prompts.jsonl --profile my-profile --methods ar,early-exit,early-exit-fixed "
    "--markdown report.md --plot report.png",
    "adaptive bench --data spec_bench.jsonl --profile my-profile --methods ar,knn-ssd --skip-first 16 --order mixed",
    "adaptive bench --data spec_bench.jsonl --profile my-profile --methods ar,knn-ssd,llama-server --skip-first 16 "
    "--temperature 1.0 --seed 7",
    "adaptive bench --data spec_bench.jsonl --profile my-profile --methods ar,knn-ssd,llama-server --all-turns "
    "--prefix-cache 256",
    "adaptive bench --data spec_bench.jsonl --profile my-profile --methods ar,knn-ssd --shared-context 4 "
    "--prefix-cache 256",
), terms=("Methods (* needs --profile)", {m.name + (" *" if m.needs_profile else ""): m.description
                                         for m in BENCH_METHODS.values()}))
@click.option("--data", "data_file", required=True, type=click.Path(dir_okay=False),
              help="Spec-Bench JSONL (question_id, category, turns) or prompt JSONL (prompt, optional category); "
                   "builtin: the shipped domains' prompts, a group each (make bench).")
@click.option("--profile", "profile_dir", type=click.Path(file_okay=False), default=None,
              help="Profile for the methods marked * below.")
@model_option
@click.option("--methods", type=NameList(BENCH_METHODS, noun="method"), default=",".join(DEFAULT_METHODS),
              show_default=True, help=f"Comma-separated, any of: {', '.join(BENCH_METHODS)} (ar is always run).")
@click.option("--per-category", type=int, default=None, help="First N prompts of each group.")
@click.option("--skip-first", type=int, default=0, show_default=True,
              help="Leave out the first N of each group (e.g. the prompts a profile was calibrated on).")
@click.option("--no-group-mt-bench", is_flag=True, help="Keep the eight MT-bench categories apart.")
@click.option("--all-turns", is_flag=True, help="Every turn, each after the earlier turns and ar's replies.")
@click.option("--shared-context", type=click.IntRange(0, len(SHARED_QUESTIONS)), default=0, show_default=True,
              help="The shared-document workload: only RAG and summarization prompts, each asked N times followed "
                   "by one of N fixed questions (separate requests sharing its text).")
@click.option("--prefix-cache", type=click.FloatRange(min=0), default=0, show_default=True, metavar="MIB",
              help="Our runtime methods keep finished requests' keys (each method its own cache, kept across "
                   "prompts) and llama-server its slot's (cache_prompt); 0: all prefilled whole.")
@click.option("--order", type=click.Choice(ORDERS), default="file", show_default=True,
              help="file: the prompts in file order (group after group); mixed: round-robin over the groups "
                   "(sorted names), a mixed-domain stream as KNN-SSD evaluates on.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Every method samples at this temperature (0: greedy, outputs compared with ar's and audited); "
                   "above 0 each prompt samples with seed --seed plus its index, and losslessness is the "
                   "distribution tests' to show, not identity's. The hf and llama.cpp methods decode greedily only.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="Nucleus sampling's mass, with --temperature (llama-server's top_k and min_p off).")
@click.option("--seed", type=int, default=0, show_default=True, help="The first prompt's sampling seed.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Unmeasured runs of every method first.")
@click.option("--threads", type=int, default=None,
              help="threads of every engine: torch's and llama.cpp's (default: torch's; llama.cpp: the CPUs).")
@dtype_option
@weights_option
@engine_option
@prefill_option
@device_option
@click.option("--out", "out_json", type=click.Path(dir_okay=False), default="report.json", show_default=True)
@click.option("--markdown", "out_md", type=click.Path(dir_okay=False), default=None,
              help="Also write a Markdown table.")
@click.option("--plot", "out_png", type=click.Path(dir_okay=False), default=None, help="Also write a PNG bar chart.")
@quiet_option
def bench_cmd(data_file, profile_dir, model_spec, methods, per_category, skip_first, no_group_mt_bench, all_turns,
              shared_context, prefix_cache, order, max_new_tokens, temperature, top_p, seed, warmup, threads, dtype,
              weights, engine, prefill, device, out_json, out_md, out_png, quiet):
    """Measure speedup, acceptance and equality with ar per group, for each method.

    Conversations (--all-turns) and questions over one shared text (--shared-context) with
    --prefix-cache add the time to the first token by turn, and the prompt tokens each method's
    cache held, below the table.
    """
    method_list = ["ar", *(m for m in methods if m != "ar")]  # ar first: the reference
    settings = BenchSettings(max_new_tokens=max_new_tokens, warmup=warmup, threads=threads, prefix_cache=prefix_cache,
                             temperature=temperature, top_p=top_p, seed=seed)
    check_sampling(method_list, settings)  # before the model loads
    needs = [m for m in method_list if BENCH_METHODS[m].needs_profile]
    if needs and not profile_dir:
        raise click.UsageError(f"method(s) {', '.join(needs)} need --profile DIR (from adaptive calibrate)")
    prompts = load_bench_prompts(data_file, per_category, not no_group_mt_bench, all_turns, skip_first, shared_context)
    if order == "mixed":
        prompts = mixed_stream(prompts)
    profile = load_profile(profile_dir, None if engine == "auto" else engine) if profile_dir else None
    for m in method_list:  # before the model loads: a missing distilled drafter is a one-line error
        if m in DISTILLED_KIND:
            _check_distilled(profile, profile_dir, m, engine)
    spec = model_spec
    if profile is not None:
        spec, dtype, weights, engine = profile_model(profile, model_spec, dtype, weights, engine)
    lm = load(spec, device, dtype, weights, engine, threads, prefill)
    report = run_bench(lm, prompts, method_list, settings, profile, progress=not quiet)
    report["settings"].update(data=str(data_file), per_category=per_category, skip_first=skip_first,
                              group_mt_bench=not no_group_mt_bench, all_turns=all_turns,
                              shared_context=shared_context, order=order)
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    table = markdown(report["results"], method_list, sampled=not settings.greedy)
    if out_md:
        Path(out_md).write_text(table, encoding="utf-8")
    if out_png:
        plot(report["results"], method_list, out_png, title=f"{lm.name} ({report['model']['dtype']}), "
             f"{max_new_tokens} new tokens, speedup over ar")
    click.echo(table)
    info(f"report written to {out_json}" + (f", {out_md}" if out_md else "") + (f", {out_png}" if out_png else ""))


def _check_distilled(profile, profile_dir, method: str, engine: str) -> None:
    """The profile holds the drafter ``method`` drafts with, or a one-line error: where the member a two-engine
    profile loads (llama.cpp) lacks it and its torch member, where drafters are trained, holds it, how to bench
    it there (every method on one engine: ``ar`` is the reference)."""
    kind = DISTILLED_KIND[method]
    try:
        profile.distilled_drafter(kind)
    except ProfileError:
        if engine == "auto" and is_two_engine(profile_dir) and kind in _training_distilled(profile_dir):
            raise click.UsageError(f"method {method} drafts with the {kind} drafter of this two-engine profile's "
                                   f"{TRAINING_ENGINE} member: bench it with --engine {TRAINING_ENGINE} (every "
                                   "method then runs on that engine)") from None
        raise


def _training_distilled(profile_dir) -> dict:
    """The distilled drafters of a two-engine profile's torch member (none where it has no such member)."""
    try:
        return load_profile(training_member(profile_dir)).distilled
    except ProfileError:
        return {}
