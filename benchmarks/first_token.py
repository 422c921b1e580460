"""Time to the first token of `python -m granite_jax.generate`, on a first run and on a second one.

    python benchmarks/first_token.py                        # a random tiny checkpoint
    python benchmarks/first_token.py --model DIR --runs 3 --json OUT.json

Each run is a fresh interpreter, timed from its start to the first byte the command streams on stdout (the first
token's text) and to its exit. The first run starts from an empty compilation cache (a new temporary directory given
as --compilation-cache), so it compiles everything; the later runs find the programs there, as a user's second run
does. A run with the cache off is timed too: what every run cost before the cache. Printed: each run's times, and the
second run against the first and against no cache, measured side by side in this one process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    sys.path.insert(0, ROOT)  # runs from a plain checkout
    from granite_jax.cli import ArgumentParser, model_dir, output_file_problem, positive_int

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--model",
        type=model_dir,
        default=None,
        help="checkpoint directory (default: a random tiny one)",
    )
    p.add_argument("--prompt", default="The quick brown fox", help="the prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens per run")
    p.add_argument("--runs", type=positive_int, default=2, help="runs sharing one cache: the first fills it")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if problem := output_file_problem("--json", args.json):
        p.fail(problem)
    return args


def timed_run(model: str, prompt: str, new_tokens: int, cache: str) -> dict[str, float]:
    """One `generate` process: seconds from its start to its first stdout byte and to its exit."""
    command = [sys.executable, "-m", "granite_jax.generate", "--model", model, "--prompt", prompt, "--quiet"]
    command += ["--max-new-tokens", str(new_tokens), "--ignore-eos", "--stream", "--compilation-cache", cache]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_ENABLE_COMP"))}
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    first = process.stdout.read(1)
    first_token_s = time.perf_counter() - start
    _, err = process.communicate()
    total_s = time.perf_counter() - start
    if process.returncode != 0 or not first:
        sys.exit(f"first_token.py: error: generate failed ({process.returncode}): {err.decode()[-2000:]}")
    return dict(first_token_s=first_token_s, total_s=total_s)


def main(argv=None) -> int:
    args = parse_args(argv)
    from granite_jax.experiments.common import environment, write_json
    from granite_jax.testing import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_checkpoint(os.path.join(tmp, "tiny-random"))
        cache = os.path.join(tmp, "xla")
        runs = [timed_run(model, args.prompt, args.max_new_tokens, cache) for _ in range(args.runs)]
        uncached = timed_run(model, args.prompt, args.max_new_tokens, "off")
    labels = ["first run (empty cache)", *(f"run {i + 2} (cached)" for i in range(len(runs) - 1))]
    for label, run in [*zip(labels, runs), ("cache off", uncached)]:
        print(f"{label:24} first token {run['first_token_s']:5.2f} s   exit {run['total_s']:5.2f} s")
    second = runs[-1]["first_token_s"] if len(runs) > 1 else float("nan")
    print(
        f"second run's first token: {second / runs[0]['first_token_s']:.2f}x the first run's, "
        f"{second / uncached['first_token_s']:.2f}x an uncached run's"
    )
    if args.json:
        doc = dict(
            command="python benchmarks/first_token.py " + " ".join(sys.argv[1:] if argv is None else argv),
            model=args.model or "random tiny checkpoint (granite_jax.testing)",
            max_new_tokens=args.max_new_tokens,
            runs=runs,
            cache_off=uncached,
            environment=environment(),
        )
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
