"""`kiln serve` (an OpenAI-compatible HTTP server) and `kiln bench serve` (a load generator against one)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import socket

from kiln.chat_template import ChatTemplateError, chat_template_of
from kiln.cli.common import (
    batch_limit_flags,
    chat_template_flag,
    device_flag,
    dtype_flag,
    engine_flags,
    generation_config_flag,
    human_int,
    model_paths_resolved,
    quantize_flag,
    routers_flag,
    seed_flag,
    serving_engine,
    spec_arg,
    step_model,
    weights_flag,
)
from kiln.errors import KilnError, UsageError

log = logging.getLogger("kiln.cli")
DRAIN_S = 30.0  # --timeout-graceful-shutdown's default


def server_root(url: str) -> str:
    """--base-url as a server's root: the URL `kiln serve` prints (and OpenAI clients take) ends in /v1, and a bare
    host:port gets http://."""
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1").rstrip("/")
    return url if "://" in url else f"http://{url}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import load_model, say
    from kiln.server import ServerConfig, build_app
    from kiln.server.drain import DrainingServer

    logging.getLogger("kiln.server").setLevel(args.log_level.upper())  # --log-level info shows ignored fields
    if not 0 <= args.port <= 65535:
        raise KilnError(f"--port {args.port}: give a TCP port from 0 to 65535")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise UsageError(f"--max-prompt-tokens {args.max_prompt_tokens}: give a number of tokens >= 1, or omit it "
                         "(prompts up to --max-model-len)")
    if args.max_body_bytes < 0:
        raise UsageError(f"--max-body-bytes {args.max_body_bytes}: give a size in bytes >= 1, or 0 for no limit")
    if args.max_waiting is not None and args.max_waiting < 1:
        raise UsageError(f"--max-waiting {args.max_waiting}: give a number of requests >= 1, or omit it (no limit, "
                         "as vLLM)")
    if any(not n for n in args.served_model_name or ()):
        raise UsageError("--served-model-name: give non-empty model ids")
    if not args.timeout_graceful_shutdown >= 0:  # NaN included
        raise UsageError(f"--timeout-graceful-shutdown {args.timeout_graceful_shutdown:g}: give seconds >= 0 (0: "
                         "abort the requests in flight at once)")
    if not _is_loopback(args.host) and not args.api_key:
        say(f"warning: serving on {args.host} (reachable from other machines) without --api-key")
    sock = _bind(args.host, args.port)  # before the model loads: a port in use fails in a second, not a minute
    m = load_model(args.spec, args.weights, dtype=args.dtype, device=args.device, seed=args.seed,
                   quantize=args.quantize, routers=args.routers, generation_config=args.generation_config)
    try:
        template = chat_template_of(m.tokenizer, args.chat_template)
    except ChatTemplateError as e:
        raise UsageError(f"--chat-template: {e}") from None
    engine = serving_engine(args, m, step_model(args, m), max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
    if args.max_prompt_tokens is not None and args.max_prompt_tokens > engine.max_model_len:
        # Not an error (one flag set for several models), but it does nothing: prompts are cut off by the length.
        log.warning("--max-prompt-tokens %d is over the max model length of %d (--max-model-len, default the model's "
                    "context), which limits prompts already: the flag has no effect; give a value below %d or drop "
                    "it", args.max_prompt_tokens, engine.max_model_len, engine.max_model_len)
    names, aliases = served_names(args, m.model.name)
    name = names[0]
    cfg = ServerConfig(model_name=names, model_aliases=aliases, api_key=args.api_key,
                       max_body_bytes=args.max_body_bytes or None, max_prompt_tokens=args.max_prompt_tokens,
                       max_waiting=args.max_waiting, chat_template=template,
                       generation_defaults=m.generation_defaults,
                       trust_request_chat_template=args.trust_request_chat_template,
                       allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                       allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    app = build_app(engine, cfg)
    note = m.generation_note()
    if note:  # as vLLM warns at startup: requests that leave these fields unset get the model's values
        say(f"{note}; a request's own values win")
    say(f"serving {name} on http://{args.host}:{sock.getsockname()[1]}/v1 ({m.device}, "
        f"{engine.block_manager.num_usable_blocks} KV blocks, chat template: {cfg.chat_template.origin}"
        f"{m.weights_label()})")
    server = DrainingServer(app, args.timeout_graceful_shutdown, log_level=args.log_level)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def served_names(args: argparse.Namespace, spec_name: str) -> tuple[list[str], list[str]]:
    """The model ids `kiln serve` answers to: (served, also accepted). --served-model-name's, as vLLM's (the first
    reported, all listed and accepted); by default the model argument as the user gave it (SPEC, else --weights),
    as vLLM names a model by the path or id it was given, with the spec's own name (kiln's earlier default) and
    --weights as given accepted too."""
    if args.served_model_name:
        return list(args.served_model_name), []
    given = [a for a in (args.spec, args.weights) if a]
    first = given[0] if given else spec_name
    aliases = [a for a in dict.fromkeys([*given, spec_name]) if a != first]
    return [first], aliases


def json_list(flag: str):
    """An argparse type: a JSON list of strings (vLLM's --allowed-origins and the like)."""

    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} {text}: give a JSON list of strings, e.g. "
                                             '\'["https://example.com"]\' (default ["*"]: any)')
        return value

    return parse


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), or a KilnError naming the address and the fix."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise KilnError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host, or "
                        "stop what holds it") from None
    return sock


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    import httpx

    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import say
    from kiln.run_info import run_metadata
    from kiln.runtime.throughput import make_trace, parse_range
    from kiln.server.bench import format_serving_report, run_serving_bench

    try:
        input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
    except ValueError as e:
        raise KilnError(f"--input-len / --output-len: {e}") from None
    if args.num_requests < 1 or args.request_rate <= 0 or (args.max_concurrency or 1) < 1:
        raise KilnError("--num-requests, --request-rate and --max-concurrency must be positive")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = server_root(args.base_url)
    try:
        models = httpx.get(f"{base}/v1/models", headers=headers, timeout=30)
        if models.status_code == 401:
            raise KilnError(f"the server at {base} wants an API key: pass the one it was started with as --api-key")
        card = models.json()["data"][0]
        health = httpx.get(f"{base}/health", timeout=30).json()
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise KilnError(f"cannot reach a kiln server at {base} ({e}); start one with `kiln serve SPEC` "
                        "or pass --base-url") from None
    trace, clipped = make_trace(args.num_requests, input_len, output_len, vocab=card["vocab_size"],
                                context=card["max_model_len"], seed=args.seed)
    say(f"bench serve: {len(trace)} requests to {base} ({card['id']}), rate {args.request_rate}/s, "
        f"max concurrency {args.max_concurrency or 'unbounded'}")
    res = asyncio.run(run_serving_bench(base, trace, model=card["id"], request_rate=args.request_rate,
                                        max_concurrency=args.max_concurrency, seed=args.seed,
                                        api_key=args.api_key))
    result = {"model": card["id"], **run_metadata(health.get("device", "cpu")), "base_url": base,
              "trace": {"num_requests": len(trace), "input_len": list(input_len), "output_len": list(output_len),
                        "seed": args.seed, "clipped": clipped, "request_rate": str(args.request_rate),
                        "max_concurrency": args.max_concurrency}, **res}
    if args.out_dir:
        slug = "".join(c if c.isalnum() else "-" for c in result["device"].lower()).strip("-")[:40]
        model = "".join(c if c.isalnum() or c in "-._" else "-" for c in card["id"]).strip("-.") or "model"
        path = Path(args.out_dir) / f"serve-{model}-{slug}-{result['date'][:10]}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {path}")
    print(json.dumps(result, indent=2) if args.json else format_serving_report(res))
    return 0 if res["failed"] == 0 else 1


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over HTTP: /v1/completions, /v1/chat/completions (streaming "
                       "with SSE), /v1/models, vLLM's /tokenize, /detokenize, /version and /ping, /health and "
                       "/metrics (Prometheus).")
    spec_arg(s)
    weights_flag(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize")
    s.add_argument("--served-model-name", metavar="NAME", nargs="+",
                   help="the model ids clients use, as vLLM's: the first is reported, every one is accepted "
                   "(default: SPEC as given, else --weights as given; the spec's own name is accepted too)")
    batch_limit_flags(s)
    s.add_argument("--max-model-len", type=human_int, metavar="N",
                   help="prompt + output tokens at most, as vLLM writes it: 4096, 4k (4000), 32K (32768) (default: "
                   "the context)")
    s.add_argument("--max-prompt-tokens", type=int, help="prompt tokens at most (default: --max-model-len)")
    s.add_argument("--max-body-bytes", type=int, default=32 << 20,
                   help="request body size limit in bytes; more get 413 (default 32 MiB: a 128k-token prompt as "
                   "token ids is about 1 MiB; 0: no limit, as vLLM)")
    s.add_argument("--max-waiting", type=int,
                   help="queued requests at most; more get 503 with Retry-After (default: no limit, as vLLM)")
    s.add_argument("--allowed-origins", type=json_list("--allowed-origins"), default=["*"], metavar="JSON",
                   help='CORS: the origins browsers may call from, a JSON list (default ["*"], as vLLM)')
    s.add_argument("--allowed-methods", type=json_list("--allowed-methods"), default=["*"], metavar="JSON",
                   help='CORS: the HTTP methods allowed, a JSON list (default ["*"])')
    s.add_argument("--allowed-headers", type=json_list("--allowed-headers"), default=["*"], metavar="JSON",
                   help='CORS: the request headers allowed, a JSON list (default ["*"])')
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")
    seed_flag(s, help="seed of random weights (default 0)")
    device_flag(s)
    dtype_flag(s)
    quantize_flag(s)
    routers_flag(s)
    generation_config_flag(s)
    chat_template_flag(s)
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat template (chat_template), as vLLM's flag (default: refused "
                   "with a 400)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--timeout-graceful-shutdown", type=float, default=DRAIN_S, metavar="SECONDS",
                   help="after SIGTERM or Ctrl-C, how long requests in flight may still run before they are aborted "
                   "(a 503 or an error event each, their KV freed) and the server exits; 0 aborts them at once, as "
                   "vLLM's --shutdown-timeout does by default; a second Ctrl-C aborts them at once too (default "
                   f"{DRAIN_S:g}; under Kubernetes keep it below terminationGracePeriodSeconds)")
    engine_flags(s)
    s.set_defaults(func=model_paths_resolved(cmd_serve))


def add_bench_serve_parser(bsub: argparse._SubParsersAction) -> None:
    b = bsub.add_parser("serve", help="load-test a running `kiln serve`: throughput, TTFT, TPOT, ITL",
                        description="Replay a seeded trace of streamed completions against a running server at "
                        "a request rate (Poisson) or a fixed concurrency; report throughput and TTFT / TPOT / "
                        "inter-token latency (mean, p50, p99) and write JSON under --out-dir.")
    b.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, as `kiln serve` prints it (with or without /v1; default http://127.0.0.1:8000)")
    b.add_argument("--api-key", metavar="KEY", help="the server's --api-key")
    b.add_argument("--num-requests", type=int, default=64, help="requests in the trace (default 64)")
    b.add_argument("--input-len", default="16:128", metavar="LO:HI", help="prompt lengths, uniform (16:128)")
    b.add_argument("--output-len", default="16:128", metavar="LO:HI", help="output lengths, uniform (16:128)")
    b.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    b.add_argument("--max-concurrency", type=int, help="requests in flight at most (default unbounded)")
    seed_flag(b, help="seed of the trace and the arrivals (default 0)")
    b.add_argument("--out-dir", default="bench/results",
                   help="where the JSON goes (default bench/results, relative to the working directory; "
                   "'' for nowhere)")
    b.add_argument("--json", action="store_true", help="print the full result as JSON")
    b.set_defaults(func=cmd_bench_serve)

