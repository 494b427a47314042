"""``adaptive serve --profile DIR``: the OpenAI-compatible HTTP server (:mod:`adaptive.serve`)."""

from __future__ import annotations

import click

from adaptive.cli.common import (
    command,
    device_option,
    dtype_option,
    engine_option,
    info,
    load_runtime,
    model_option,
    prefill_option,
    weights_option,
)
from adaptive.engine.prefix import DEFAULT_PREFIX_CACHE_MIB
from adaptive.errors import ConfigError
from adaptive.serve import DEFAULT_PREFILL_CHUNK


class ReplicaId(click.ParamType):
    """A replica id: letters, digits, '.', '_' or '-' (it names a file)."""

    name = "replica-id"

    def convert(self, value, param, ctx):
        from adaptive.profile.overlay import check_replica_id

        try:
            return check_replica_id(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@command("serve", examples=(
    "adaptive serve --profile my-profile",
    "adaptive serve --profile my-profile --port 8001 --api-key \"$KEY\" --max-queue 16 --max-batch 4",
    "adaptive serve --profile my-profile --host 0.0.0.0 --served-model-name assistant --drain-timeout 60",
    "adaptive serve --profile /shared/my-profile --replica-id web-1 --port 8001",
), hints={"--policy": "choose speculation per request: the body's \"speculation\" field (auto, off or a policy)"})
@click.option("--profile", "profile_dir", required=True, type=click.Path(file_okay=False),
              help="Calibration profile (`adaptive calibrate`) that routes each request.")
@model_option
@dtype_option
@weights_option
@engine_option
@prefill_option
@device_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: a free port.")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests decoded together, verified in one forward per step (1: one at a time).")
@click.option("--prefill-chunk", type=click.IntRange(min=0), default=DEFAULT_PREFILL_CHUNK, show_default=True,
              help="Prompt tokens prefilled between two decoding steps: a long prompt joins in chunks and the "
              "running requests keep their pace (0: whole prompts).")
@click.option("--goodput/--no-goodput", default=True, show_default=True,
              help="Price a batch's drafts together: each step, the draft lengths that maximise the batch's expected "
              "tokens per second on this engine's measured verification costs (off: each request as if alone).")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests that may wait for the model; more are refused with 429.")
@click.option("--max-body", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="Largest request body in bytes; larger is refused with 413.")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="New tokens when a request gives no max_tokens (at most what the context leaves).")
@click.option("--api-key", envvar="ADAPTIVE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (or set ADAPTIVE_API_KEY).")
@click.option("--served-model-name", default=None, help="The model's name in /v1/models and requests "
              "[default: the profile's model].")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="On SIGTERM/SIGINT: seconds in-flight requests may take to finish.")
@click.option("--online/--no-online", default=True, show_default=True,
              help="Learn from the traffic served (bigram tables, bandits, new domains), saved beside the profile.")
@click.option("--online-path", type=click.Path(dir_okay=False), default=None,
              help="The online overlay [default: PROFILE.online beside the profile; each replica writes "
              "PROFILE.online.d/REPLICA.online].")
@click.option("--replica-id", type=ReplicaId(), default=None,
              help="This server's name among replicas sharing the profile (its own overlay file) "
              "[default: HOST-PID]. Give a stable one to continue a replica's learning after a restart.")
@click.option("--merge-interval", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Seconds between reads of the other replicas' overlays while serving (0: before every "
              "request's learning).")
@click.option("--refine-heads/--no-refine-heads", default=True, show_default=True,
              help="With --online, where a profile's eagle head drafts (torch engine): refine each domain's head "
              "on its served greedy text in the background, adopting a refined one only where its held-out "
              "first drafts are kept more often (saved as PROFILE.online.d/REPLICA.head-DOMAIN.safetensors).")
@click.option("--prefix-cache", type=click.FloatRange(min=0), default=DEFAULT_PREFIX_CACHE_MIB, show_default=True,
              metavar="MIB", help="MiB of finished requests' keys and values each engine keeps for requests that start "
              "with the same tokens (a conversation's next turn, a shared system prompt or document); 0: none.")
def serve_cmd(profile_dir, model_spec, dtype, weights, engine, prefill, device, host, port, max_batch, prefill_chunk,
              goodput, max_queue, max_body, default_max_tokens, api_key, served_model_name, drain_timeout, online,
              online_path, replica_id, merge_interval, refine_heads, prefix_cache):
    """Serve a profile over OpenAI's HTTP API (chat and text completions, streaming, metrics).

    Each request is routed by the profile like `adaptive generate`; its body may choose speculation
    with the extension field "speculation": "auto" (the profile's decision), "off" (plain decoding)
    or a routing policy (knn-ssd, knn-skip, ssd-static, cascade, ...). Responses' usage carries an
    "adaptive" object: the routed domain, the drafter, acceptance. Up to --max-batch requests are
    decoded together: each step drafts for each of them and verifies all in one forward; waiting
    requests join as others finish, their prompts prefilled --prefill-chunk tokens between steps;
    the batch's draft lengths are priced together (--goodput). A request that starts with the tokens
    of one finished before (a conversation re-sending its history, a shared system prompt or
    document) starts from their cached keys (--prefix-cache); usage.prompt_tokens_details.cached_tokens
    says how many.
    Online learning (on by default) updates each domain's bigram table and bandits from the
    accepted output, discovers new domains among out-of-domain requests (measured in the
    background within a tenth of the model's time while serving is busy) and saves it all to
    PROFILE.online.d/REPLICA.online. Where the profile's eagle head drafts (torch), each domain's
    head is refined on its served text too, within the same share of the model (--refine-heads).
    Several servers over one profile directory (replicas behind a load balancer) each write their
    own and merge the others' (see docs/deployment.md, `adaptive profile show`,
    `adaptive profile reset-online`).
    Needs the serve extra: pip install 'adaptive[serve]'.

    \b
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}'
    """
    try:
        import uvicorn  # noqa: F401  (imported where it runs; checked here, before the model loads)

        from adaptive.serve.app import create_app, serve
    except ImportError as exc:
        raise ConfigError(f"adaptive serve needs the serve extra ({exc.name} is missing): "
                          "pip install 'adaptive[serve]'") from None
    from adaptive.runtime.online import OnlineSettings

    learning = OnlineSettings(enabled=online, path=online_path, replica=replica_id, merge_interval=merge_interval)
    rt = load_runtime(profile_dir, model_spec, device, dtype, weights, engine, online=learning, goodput=goodput,
                      prefix_cache=prefix_cache, prefill=prefill)
    if online and refine_heads:  # within the online learner's share of the model
        from adaptive.distill.refine import attach_refiner
        from adaptive.runtime.turns import ShareGuard

        if attach_refiner(rt, guard_for=lambda lock: ShareGuard(lock, learning.share, learning.idle_s),
                          replica=replica_id) is not None:
            info("refining the eagle head on the traffic served (--no-refine-heads: off)")
    rt.reserve_batch(max_batch)  # before warming: the graphs are captured on the caches' batched layout
    captured = rt.warm()
    if captured:
        info(f"captured {captured} CUDA graphs of the model's steps")
    app = create_app(rt, served_model=served_model_name, api_key=api_key, max_queue=max_queue, max_batch=max_batch,
                     prefill_chunk=prefill_chunk, max_body=max_body, default_max_tokens=default_max_tokens,
                     drain_timeout=drain_timeout)
    if app.state.scheduler.batched_graphs:
        info(f"batched steps replay CUDA graphs (up to {max_batch} requests a step)")

    def ready(server):
        sock = server.servers[0].sockets[0].getsockname() if server.servers else (host, port)
        info(f"serving {app.state.model_name} on http://{sock[0]}:{sock[1]} (Ctrl-C or SIGTERM to stop)")

    serve(app, host=host, port=port, drain_timeout=drain_timeout, on_ready=ready)
    info("stopped")
