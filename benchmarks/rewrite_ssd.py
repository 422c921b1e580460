"""Benchmark: the naive SSD, the same function rewritten by `rewriter`, and the hand-written einsum SSD ("xla"),
at granite-4.0-h-tiny Mamba dims (48 heads x 64, state 128, one group, chunk 256), measured in one run.

For each length: XLA's compiled temporary memory (`memory_analysis().temp_size_in_bytes`), compile time, and
wall time per call (min and median of interleaved repetitions, so background load hits all three alike), and XLA's
own FLOP count of the compiled program (`cost_analysis()`), which no background load disturbs. The measurement is
`granite_jax.experiments.rewrite.bench_length` (the rewrite experiment's); this script adds the table and the JSON.

    python benchmarks/rewrite_ssd.py --lengths 512 2048 8192 --json benchmarks/results/rewrite-ssd-$(date +%F).json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a plain checkout

from granite_jax.cli import ArgumentParser, output_file_problem, positive_int  # noqa: E402


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


def table(results: list[dict]) -> str:
    from granite_jax.experiments.rewrite import VARIANTS

    header = f"{'L':>6}  {'impl':<10}{'min s':>10}{'median s':>10}{'temp MiB':>10}{'GFLOP':>9}{'compile s':>10}  note"
    lines = [header, "-" * len(header)]
    for r in results:
        for name in VARIANTS:
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
    import jax

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
    import jax
    from tqdm import tqdm

    from granite_jax.experiments import rewrite

    fields = {f.name for f in dataclasses.fields(rewrite.Setup)}
    setup = rewrite.Setup(**{k: v for k, v in vars(args).items() if k in fields})
    total = rewrite.calls(setup, args.lengths)
    with tqdm(total=total, desc="rewrite_ssd", unit="call", file=sys.stderr, disable=None) as bar:
        results = rewrite.measure_lengths(setup, args.lengths, bar)
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
