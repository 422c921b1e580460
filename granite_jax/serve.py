"""The command line for serving: `python -m granite_jax.serve`, an OpenAI-compatible HTTP server.

    python -m granite_jax.serve --model DIR --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "Hello", "max_tokens": 16}'

The work is the `Engine`'s (continuous batching, `granite_jax.serving`); the HTTP layer is FastAPI under uvicorn.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Sequence

from granite_jax import cli
from granite_jax.checkpoint import AUTO, DTYPES, NO_MODEL_MESSAGE, WEIGHT_DTYPES, default_model_dir
from granite_jax.errors import InputError
from granite_jax.ops import SSD_IMPLS, Runtime

PROG = "python -m granite_jax.serve"


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog=PROG,
        description="Serve a Granite 4.0 (GraniteMoeHybrid) checkpoint over HTTP with OpenAI's API: /v1/completions "
        'and /v1/chat/completions (streamed as server-sent events with "stream": true), /v1/models and /health. '
        "Requests are batched continuously: each joins the running decode batch once its prompt is prefilled and "
        "leaves it when it stops; prompts that begin like earlier ones reuse their state (prefix caching).",
        epilog="Examples:\n"
        "  python -m granite_jax.serve --model ckpt/granite-4.0-h-350m --port 8000\n"
        "  python -m granite_jax.serve --model DIR --max-batch 32 --max-context 8192 --dtype bfloat16\n\n"
        "  from openai import OpenAI\n"
        '  client = OpenAI(base_url="http://localhost:8000/v1", api_key="none")\n'
        '  client.chat.completions.create(model="granite", messages=[{"role": "user", "content": "Hi"}])\n\n'
        "The server prints 'serving MODEL on http://HOST:PORT' once it is ready, and shuts down gracefully on "
        "SIGTERM or Ctrl-C. Exit status: 0 after a shutdown, 2 on invalid input (bad flag, missing model, port in "
        "use).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        type=cli.model_dir,
        metavar="DIR",
        help="checkpoint directory (Hugging Face GraniteMoeHybrid with tokenizer files, or its orbax conversion); "
        "default: the model shipped with granite-jax (a small Granite hybrid trained on Python's standard library)",
    )
    m.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: DIR's name)")
    m.add_argument("--dtype", choices=DTYPES, default="float32", help="arithmetic dtype (float32)")
    m.add_argument(
        "--weight-dtype",
        choices=[AUTO, *WEIGHT_DTYPES],
        default=AUTO,
        help="keep the weights in this dtype instead of --dtype (as python -m granite_jax.generate; auto)",
    )
    m.add_argument(
        "--ssd-impl",
        choices=SSD_IMPLS,
        default="xla",
        help="Mamba-2 SSD implementation of the prefill (as python -m granite_jax.generate; pallas: NVIDIA GPUs, with "
        "--dtype bfloat16) (xla)",
    )
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1; 0.0.0.0 for every one)")
    n.add_argument("--port", type=int, default=8000, help="port to listen on (8000; 0: any free one, printed)")
    n.add_argument(
        "--shutdown-timeout",
        type=cli.positive_float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, seconds for in-flight requests to finish before they are cancelled (30)",
    )
    n.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="warning",
        help="uvicorn's log level; info adds a line a request (warning)",
    )
    b = p.add_argument_group("batching")
    b.add_argument("--max-batch", type=cli.positive_int, default=32, metavar="B", help="decode slots (32)")
    b.add_argument(
        "--max-context",
        type=cli.positive_int,
        default=4096,
        metavar="T",
        help="longest prompt plus completion of a request, in tokens (4096); longer ones get a 400",
    )
    b.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests waiting for a slot; more get a 503 with Retry-After (64)",
    )
    b.add_argument(
        "--prefill-chunk",
        type=cli.positive_int,
        default=256,
        metavar="N",
        help="longest prefill piece when no request is decoding (256)",
    )
    b.add_argument(
        "--prefill-budget",
        type=cli.positive_int,
        default=32,
        metavar="N",
        help="longest prefill piece between two decode steps while requests are decoding: bounds how much a new "
        "prompt delays the running ones' next tokens (32)",
    )
    b.add_argument(
        "--feed-below",
        type=cli.positive_int,
        default=16,
        metavar="N",
        help="while requests are decoding, a new prompt's last tokens (fewer than N) are fed by the decode steps, one "
        "a step, instead of prefilled: they ride along in the batch (16)",
    )
    b.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=1024.0,
        metavar="MB",
        help="memory for prefix-cache snapshots (hybrid state at prompt ends and where prompts part); 0: off (1024)",
    )
    cli.add_cache_argument(p)
    return p


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening socket (InputError naming the address if it cannot be had)."""
    if not 0 <= port < 65536:
        raise InputError(f"--port {port}: expected 0-65535")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        raise InputError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from granite_jax.generation import Generator
    from granite_jax.serving import Engine
    from granite_jax.serving.api import create_app

    if args.max_queue < 0:
        raise InputError(f"--max-queue {args.max_queue}: expected an integer >= 0")
    if args.prefix_cache_mb < 0:
        raise InputError(f"--prefix-cache-mb {args.prefix_cache_mb}: expected a number >= 0")
    model_dir = args.model or default_model_dir()
    if model_dir is None:
        raise InputError(NO_MODEL_MESSAGE)
    sock = listening_socket(args.host, args.port)  # before the model loads: a taken port fails at once
    cli.use_compilation_cache(args.compilation_cache)
    generator = Generator(
        model_dir,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        runtime=Runtime(ssd=args.ssd_impl),
        progress=sys.stderr.isatty(),
    )
    engine = Engine(
        generator,
        max_batch=args.max_batch,
        max_context=args.max_context,
        prefill_chunk=args.prefill_chunk,
        prefill_budget=args.prefill_budget,
        feed_below=args.feed_below,
        max_queue=args.max_queue,
        prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
    )
    engine.warmup()
    name = args.served_model_name or os.path.basename(os.path.normpath(model_dir))
    config = uvicorn.Config(
        create_app(engine, name),
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    engine.start()
    print(f"serving {name} on http://{host}:{port}", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler it found: a no-op one
    # makes that shutdown exit with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop(timeout=args.shutdown_timeout)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.guarded("granite_jax.serve", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
