"""Benchmark: the naive SSD, the same function rewritten by `rewriter`, and the hand-written einsum SSD ("xla"),
at granite-4.0-h-tiny Mamba dims (48 heads x 64, state 128, one group, chunk 256), measured in one run.

For each length: XLA's compiled temporary memory (`memory_analysis().temp_size_in_bytes`), compile time, and
wall time per call (min and median of interleaved repetitions, so background load hits all three alike), and XLA's
own FLOP count of the compiled program (`cost_analysis()`), which no background load disturbs.

    python benchmarks/rewrite_ssd.py --lengths 512 2048 8192 --json benchmarks/results/rewrite-ssd-$(date +%F).json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import rewriter
from granite_jax.cli import ArgumentParser, output_file_problem, positive_int
from granite_jax.generate import available_memory
from granite_jax.ssd import ssd_chunked, ssd_chunked_naive

IMPLS = ("naive", "rewritten", "xla")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and every flag's default."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description=__doc__, formatter_class=_Formatter
    )  # an error is one line (no usage block), exit code 2
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 2048, 8192], help="sequence lengths L")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size b")
    p.add_argument("--heads", type=positive_int, default=48, help="SSM heads h (a multiple of --groups)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dimension p")
    p.add_argument("--state", type=positive_int, default=128, help="state size n")
    p.add_argument("--groups", type=positive_int, default=1, help="groups g of B and C, each shared by h / g heads")
    p.add_argument("--chunk", type=positive_int, default=256, help="chunk size of the chunked SSD")
    p.add_argument("--reps", type=positive_int, default=7, help="timed calls of the rewritten and xla SSDs per length")
    p.add_argument("--naive-reps", type=positive_int, default=2, help="timed calls of the naive SSD per length")
    p.add_argument(
        "--max-naive-seconds",
        type=float,
        default=300.0,
        help="skip the naive SSD at a length where one call is predicted (linearly in L) to take longer",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.heads % args.groups:
        p.error(
            f"--heads must be a multiple of --groups (each group is shared by h / g heads): {args.heads} heads, "
            f"{args.groups} groups"
        )
    if (problem := output_file_problem("--json", args.json)) is not None:
        p.error(problem)
    return args


def inputs(args: argparse.Namespace, length: int) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(length)
    b, h, p, g, n = args.batch, args.heads, args.head_dim, args.groups, args.state
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    dt = jnp.asarray(rng.uniform(0.001, 0.1, (b, length, h)), jnp.float32)
    A = -jnp.asarray(rng.uniform(1.0, 16.0, (h,)), jnp.float32)
    return f32(b, length, h, p), dt, A, f32(b, length, g, n), f32(b, length, g, n), f32(h)


def functions(chunk: int) -> dict[str, jax.stages.Wrapped]:
    naive = functools.partial(ssd_chunked_naive, chunk_size=chunk)
    return {
        "naive": jax.jit(naive),
        "rewritten": jax.jit(rewriter.rewrite(naive)),
        "xla": jax.jit(functools.partial(ssd_chunked, chunk_size=chunk)),
    }


def timed(compiled, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start


def bench_length(args: argparse.Namespace, length: int, fns: dict, naive_per_token: float | None, bar) -> dict:
    """Compile all three, check the rewritten output, then time them interleaved."""
    xs = inputs(args, length)
    result = {"L": length, "impls": {}}
    compiled = {}
    for name in IMPLS:
        record = result["impls"][name] = {}
        if name == "naive" and naive_per_token is not None:
            predicted = naive_per_token * length
            if predicted > args.max_naive_seconds:
                record["skipped"] = f"predicted {predicted:.0f} s per call (linear in L) > --max-naive-seconds"
                continue
        start = time.perf_counter()
        compiled[name] = fns[name].lower(*xs).compile()
        record["compile_s"] = time.perf_counter() - start
        record["temp_bytes"] = int(compiled[name].memory_analysis().temp_size_in_bytes)
        record["xla_flops"] = float((compiled[name].cost_analysis() or {}).get("flops", float("nan")))
        if record["temp_bytes"] > 0.8 * (available_memory() or 1 << 62):
            record["skipped"] = f"needs {record['temp_bytes'] / 2**30:.1f} GiB temporaries, more than is free"
            del compiled[name]
    outs = {name: jax.block_until_ready(c(*xs)) for name, c in compiled.items()}  # warm-up, and correctness
    for name, out in outs.items():
        scale = float(jnp.abs(outs["xla"][0]).max())
        result["impls"][name]["max_abs_diff_vs_xla"] = float(jnp.abs(out[0] - outs["xla"][0]).max())
        result["impls"][name]["rel_diff_vs_xla"] = result["impls"][name]["max_abs_diff_vs_xla"] / scale
    times = {name: [] for name in compiled}
    for rep in range(args.reps):
        for name, c in compiled.items():
            if name == "naive" and rep >= args.naive_reps:
                continue
            times[name].append(timed(c, xs))
            bar.update(1)
    for name, ts in times.items():
        result["impls"][name] |= {"min_s": min(ts), "median_s": statistics.median(ts), "times_s": ts}
    report = rewriter.analyze(fns["naive"], *xs)
    result["sites"] = [f"{s.status}: {s.spec} ({s.reason or 'dot_general'})" for s in report.sites]
    return result


def ratios(result: dict) -> dict:
    impls = result["impls"]
    out = {}
    if "min_s" in impls["naive"]:
        out["naive_over_rewritten"] = impls["naive"]["min_s"] / impls["rewritten"]["min_s"]
    out["rewritten_over_xla"] = impls["rewritten"]["min_s"] / impls["xla"]["min_s"]
    out["rewritten_over_xla_median"] = impls["rewritten"]["median_s"] / impls["xla"]["median_s"]
    # calls of the two alternate, so each pair saw about the same background load
    pairs = [r / x for r, x in zip(impls["rewritten"]["times_s"], impls["xla"]["times_s"])]
    out["rewritten_over_xla_paired_median"] = statistics.median(pairs)
    return out


def table(results: list[dict]) -> str:
    header = f"{'L':>6}  {'impl':<10}{'min s':>10}{'median s':>10}{'temp MiB':>10}{'GFLOP':>9}{'compile s':>10}  note"
    lines = [header, "-" * len(header)]
    for r in results:
        for name in IMPLS:
            rec = r["impls"][name]
            if "skipped" in rec:
                dashes = f"{'-':>10}{'-':>10}{'-':>10}{'-':>9}{'-':>10}"
                lines.append(f"{r['L']:>6}  {name:<10}{dashes}  skipped: {rec['skipped']}")
                continue
            note = f"max rel diff vs xla {rec['rel_diff_vs_xla']:.1e}" if name != "xla" else ""
            lines.append(
                f"{r['L']:>6}  {name:<10}{rec['min_s']:>10.3f}{rec['median_s']:>10.3f}"
                f"{rec['temp_bytes'] / 2**20:>10.1f}{rec['xla_flops'] / 1e9:>9.2f}{rec['compile_s']:>10.1f}  {note}"
            )
        rat = r["ratios"]
        speedup = f"naive/rewritten {rat['naive_over_rewritten']:.1f}x, " if "naive_over_rewritten" in rat else ""
        lines.append(
            f"{'':>6}  ratios: {speedup}rewritten/xla {rat['rewritten_over_xla']:.2f} (min), "
            f"{rat['rewritten_over_xla_median']:.2f} (median), {rat['rewritten_over_xla_paired_median']:.2f} (paired)"
        )
    return "\n".join(lines)


def environment() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "load_average_at_end": load,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fns = functions(args.chunk)
    results, naive_per_token = [], None
    steps = sum(args.reps * 2 + min(args.reps, args.naive_reps) for _ in args.lengths)
    with tqdm(total=steps, desc="rewrite_ssd", unit="call", file=sys.stderr) as bar:
        for length in sorted(args.lengths):
            bar.set_postfix(L=length)
            result = bench_length(args, length, fns, naive_per_token, bar)
            result["ratios"] = ratios(result)
            if "min_s" in result["impls"]["naive"]:
                naive_per_token = result["impls"]["naive"]["min_s"] / length
            results.append(result)
    dims = f"b={args.batch}, h={args.heads}, p={args.head_dim}, n={args.state}, g={args.groups}, chunk={args.chunk}"
    print(f"SSD at {dims}, float32, {jax.devices()[0]}")
    print(table(results))
    for r in results:
        print(f"  L={r['L']} sites: " + "; ".join(r["sites"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "environment": environment(), "results": results}, f, indent=2)
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
