"""``adaptive decode PROMPT`` (the engine, with a drafter you choose) and ``adaptive generate
PROMPT --profile DIR`` (the runtime: the profile routes the prompt and chooses the drafter).

The two paths take different options, so that no invalid combination parses: ``decode`` has the
drafter and its skip set, ``generate`` the profile and the routing policy.
"""

from __future__ import annotations

import sys

import click

from adaptive.cli.common import (
    LayerList,
    MessagesFile,
    command,
    device_option,
    dtype_option,
    echo_json,
    engine_option,
    info,
    json_option,
    load,
    load_runtime,
    model_option,
    prefill_option,
    sampling_config,
    sampling_options,
    weights_option,
)
from adaptive.drafters.factory import DRAFTERS, LAYER_SKIP_DRAFTERS, DrafterSpec, build_drafter
from adaptive.engine.engine import Engine
from adaptive.engine.prefix import DEFAULT_PREFIX_CACHE_MIB
from adaptive.engine.skip import SkipSet
from adaptive.runtime.policies import DISTILLED, POLICIES, ROUTED_POLICY

# the distilled drafters draft with parts `adaptive distill` trains and stores in a profile:
# `generate --profile DIR --policy early-exit|draft-model` decodes with them
DECODE_DRAFTERS = {k: v for k, v in DRAFTERS.items() if k not in DISTILLED}

stream_option = click.option("--stream", is_flag=True, help="Print text as it is accepted.")


@command("decode", examples=(
    'adaptive decode "Write a haiku about rain" --drafter ssd --skip-attn 4,7,9,20,25 --skip-mlp 22',
    'adaptive decode "def fib(n):" --raw --drafter pld --draft-len 6 --stream',
    'adaptive decode "Summarise: ..." --drafter cascade --skip-attn 10-14 --json',
    'adaptive decode "Tell me a story" --drafter ar --temperature 0.8 --top-p 0.95 --seed 1',
), terms=("Drafters", DECODE_DRAFTERS), hints={
    "--profile": "decoding through a profile is `adaptive generate PROMPT --profile DIR`",
    "--policy": "a routing --policy needs --profile: use `adaptive generate PROMPT --profile DIR --policy NAME`",
    "--full-vocab": "a reduced draft vocabulary comes from a profile: `adaptive generate --profile DIR --full-vocab`",
    "--method": "choose the drafter with --drafter",
})
@click.argument("prompt")
@model_option
@click.option("--drafter", type=click.Choice(list(DECODE_DRAFTERS)), default="ssd", show_default=True,
              help="What drafts (below); ssd needs a skip set.")
@click.option("--skip-attn", type=LayerList(), default="", help="Attention sublayers skipped while drafting (ssd, "
              "cascade), e.g. 3,5,10-14.")
@click.option("--skip-mlp", type=LayerList(), default="", help="MLP sublayers skipped while drafting (ssd, cascade).")
@click.option("--draft-len", type=int, default=4, show_default=True, help="Most tokens drafted per step.")
@sampling_options
@click.option("--raw", is_flag=True, help="Encode the prompt as raw text, without the chat template.")
@dtype_option
@weights_option
@engine_option
@prefill_option
@device_option
@stream_option
@json_option
def decode_cmd(prompt, model_spec, drafter, skip_attn, skip_mlp, draft_len, raw, dtype, weights, engine, prefill,
               device, stream, as_json, **sampling):
    """Decode PROMPT with the drafter you choose (no profile) and print the text.

    The output is what plain decoding (`--drafter ar`) gives, token for token when greedy. With
    --json: one object with text, token_ids, finish_reason, drafter and stats.
    """
    cfg = sampling_config(sampling, draft_len=draft_len)
    skip = SkipSet(skip_attn, skip_mlp)
    if skip and drafter not in LAYER_SKIP_DRAFTERS:
        raise click.UsageError(f"--skip-attn/--skip-mlp are for --drafter {' or '.join(LAYER_SKIP_DRAFTERS)}, "
                               f"not {drafter}")
    spec = DrafterSpec(drafter, skip=skip or None)  # before the model loads: `ssd` without a skip set is an error
    lm = load(model_spec, device, dtype, weights, engine, prefill=prefill)
    skip.validate_for(lm.n_layers)
    items = Engine(lm).stream(prompt, cfg, drafter=build_drafter(spec, lm.backbone), chat=False if raw else None)
    result = _print_stream(items, lm, stream, as_json)
    if not as_json:
        s = result.stats
        info(f"[{drafter}] {s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance {s.acceptance_rate:.2f}, "
             f"{s.mean_accepted_tokens:.2f} tokens/step")


@command("generate", examples=(
    'adaptive generate "Integrate x^2 from 0 to 3" --profile my-profile',
    'adaptive generate "Summarise: ..." --profile my-profile --policy cascade --stream',
    'adaptive generate "What is 17 * 23?" --profile my-profile --policy early-exit --json',
    'adaptive generate "Fix this bug: ..." --profile my-profile --fixed-draft-len --full-vocab',
    "adaptive generate --messages conversation.json --profile my-profile",
    "adaptive generate --chat --profile my-profile   # a conversation, one user turn per line of stdin",
), terms=("Policies", {name: p.description for name, p in POLICIES.items()}), hints={
    "--profile": "without a profile, `adaptive decode PROMPT --drafter ...` decodes with a drafter you choose",
    "--skip-attn": "the skip set comes from the profile (`adaptive decode --skip-attn` takes one)",
    "--skip-mlp": "the skip set comes from the profile (`adaptive decode --skip-mlp` takes one)",
    "--draft-len": "draft lengths come from the profile (`--fixed-draft-len`: calibration's, no bandit)",
    "--drafter": "the drafter comes from the profile; choose how the prompt is routed with --policy",
    "--raw": "with a profile the prompt is encoded as at calibration (`adaptive decode --raw` takes raw text)",
    "--method": "choose the routing with --policy",
})
@click.argument("prompt", required=False)
@click.option("--messages", type=MessagesFile(), default=None,
              help="A conversation to answer instead of PROMPT: a JSON list of {\"role\", \"content\"} objects "
                   "(-: stdin).")
@click.option("--chat", is_flag=True, help="Go on as a conversation: each line of stdin is the next user turn, "
              "answered after the turns and replies so far (whose keys the prefix cache holds).")
@click.option("--prefix-cache", type=click.FloatRange(min=0), default=DEFAULT_PREFIX_CACHE_MIB, show_default=True,
              metavar="MIB", help="MiB of finished turns' keys and values kept for the next turn (0: none).")
@click.option("--profile", "profile_dir", required=True, type=click.Path(file_okay=False),
              help="Calibration profile (`adaptive calibrate`) that routes the prompt.")
@click.option("--policy", type=click.Choice(list(POLICIES)), default=ROUTED_POLICY, show_default=True,
              help="How the prompt is routed to a drafter (below).")
@click.option("--full-vocab", is_flag=True,
              help="Draft with the full LM head even where the domain has a reduced draft vocabulary.")
@click.option("--fixed-draft-len", is_flag=True,
              help="Draft calibration's fixed draft length instead of Thompson-sampling it.")
@model_option
@sampling_options
@dtype_option
@weights_option
@engine_option
@prefill_option
@device_option
@click.option("--online/--no-online", default=True, show_default=True,
              help="Use what `adaptive serve` learned (PROFILE.online: tables, bandits, learned domains); "
                   "generate itself saves nothing.")
@stream_option
@json_option
def generate_cmd(prompt, messages, chat, prefix_cache, profile_dir, policy, full_vocab, fixed_draft_len, online,
                 model_spec, dtype, weights, engine, prefill, device, stream, as_json, **sampling):
    """Decode PROMPT (or a conversation: --messages, --chat) through a profile (the runtime) and print the text.

    The prompt is routed to its domain (or out-of-domain: the global record), which says what
    drafts and how long. With a two-engine profile the prompt first goes to the engine expected to
    finish it first (`engine`, `engine_choice` with the expected times). With --json: one object
    with the text, token_ids, stats, the route, the domain applied, the drafter and its draft lengths
    (with --chat: one line per turn). With --chat, each turn after the first starts from the keys
    of the turns before it (stats.cached_tokens), as `adaptive serve` does for a client re-sending
    its conversation.
    """
    if prompt is not None and messages is not None:
        raise click.UsageError("give PROMPT or --messages, not both")
    if prompt is None and messages is None and not chat:
        raise click.UsageError("give a PROMPT, --messages FILE or --chat")
    if chat and messages is None and prompt is None and sys.stdin.isatty():
        info("a conversation: type a user turn per line, Ctrl-D to end")
    sampling_config(sampling)  # validated before the model loads
    from adaptive.runtime.online import OnlineSettings

    rt = load_runtime(profile_dir, model_spec, device, dtype, weights, engine, reduced_vocab=not full_vocab,
                      bandit=not fixed_draft_len, online=OnlineSettings(enabled=online, persist=False),
                      prefix_cache=prefix_cache, prefill=prefill)
    if not chat:
        _answer(rt, messages if messages is not None else prompt, policy, stream, as_json, sampling)
        return
    history = list(messages or ([{"role": "user", "content": prompt}] if prompt is not None else []))
    lines = sys.stdin
    while True:
        if not history or history[-1]["role"] == "assistant":
            line = lines.readline()
            if not line:
                return
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.rstrip("\n")})
        result = _answer(rt, history, policy, stream, as_json, sampling)
        history.append({"role": "assistant", "content": result.text})


def _answer(rt, prompt, policy: str, stream: bool, as_json: bool, sampling: dict):
    """Decode one prompt or conversation through the runtime, print it and what decoded it: the result."""
    items = rt.stream(prompt, policy=policy, **sampling)
    result = _print_stream(items, rt.lm, stream, as_json, getattr(rt, "runtimes", None))
    if as_json:
        return result
    s = result.stats
    where = "out-of-domain (global set)" if result.domain is None else f"domain {result.domain}"
    how = []
    if result.skip and result.drafter in LAYER_SKIP_DRAFTERS:
        how.append(f"skip {result.skip.to_text()}")
    if result.draft_lengths:
        how.append(f"draft lengths {dict(sorted(result.draft_lengths.items()))}")
    if result.engine_choice is not None:
        info(f"on the {result.engine} engine: {result.engine_choice['reason']} "
             f"({result.engine_choice['prompt_tokens']} prompt tokens, {result.engine_choice['new_tokens']} new)")
    cached = f", {s.cached_tokens} of {s.prompt_tokens} prompt tokens cached" if s.cached_tokens else ""
    info(f"[{policy}] {where}, decoded with {result.drafter}" + (f" ({', '.join(how)})" if how else "")
         + f": {s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance {s.acceptance_rate:.2f}{cached}")
    return result


def _print_stream(items, lm, stream: bool, as_json: bool, members: dict | None = None):
    """Print text deltas (``--stream``), then the text or the JSON object (the result's, with the
    model's name, engine and dtype: of the engine that decoded it, among a two-engine runtime's
    ``members``); return the result."""
    result = None
    for item in items:
        if isinstance(item, str):
            if stream and not as_json:
                click.echo(item, nl=False)
        else:
            result = item
    if as_json:
        lm = members[result.engine].lm if members and result.engine in members else lm
        echo_json({**result.to_dict(), "model": lm.name, "engine": lm.engine,
                   "dtype": lm.dtype_name,
                   "weights": lm.weights})
    elif stream:
        click.echo()
    else:
        click.echo(result.text)
    return result
