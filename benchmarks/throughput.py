"""Prefill and decode throughput of granite-jax and transformers on the same random checkpoint, on this CPU.

    python benchmarks/throughput.py                       # granite-4.0-h-350m shape, batch 1 and 8
    python benchmarks/throughput.py --layers 4 --new-tokens 8 --prompt-len 64   # a quick look

Random weights of a released shape (or --checkpoint), loaded into granite-jax and transformers as `compare` does;
then, in one run: the memory bandwidth (probed before and after the speed runs, best of both) and batch-1 decode
floor (`granite_jax.experiments.throughput.memory_bandwidth`), and `granite_jax.compare.speed` at every batch size:
granite-jax through `compare.measure` (greedy, EOS ignored, compilation excluded) and transformers' `generate`
with per-token timestamps. The same measurement as `python -m granite_jax.compare` and the throughput experiment;
this script adds the table and the JSON. Prefill tokens/s = batch * prompt_len / time to first token; decode
tokens/s = batch * (new_tokens - 1) / time for the remaining tokens. The floor is parameter bytes / bandwidth: one
decode step reads every weight once. That bandwidth is a burst (the best single read of many). A shared host's
bandwidth moves between levels for seconds at a time, so with batch 1 the script also runs --floor-pairs batch-1
generations, each between two sustained reads of the bytes its decode read (`paired_floor`): the floor of the moment
it ran. It prints each pair's ratio, the median and lowest over the steady pairs (reads within 10%), and every pair
pooled with no threshold (all decode tokens over their seconds against all read bytes over theirs); --plot draws the
pairs over time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tqdm.auto import tqdm


def parse_args(argv=None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, output_file_problem, positive_int, positive_ints

    p = ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints a table (and, with --json, a JSON document).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--shape", default="granite-4.0-h-350m", help="random weights of this released architecture")
    p.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="with --shape: N layers, same share of attention (a quicker run; None: all of the shape's)",
    )
    p.add_argument("--checkpoint", default=None, help="use this checkpoint directory (HF or orbax) instead")
    p.add_argument("--prompt-len", type=positive_int, default=256, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=17, help="generated tokens per sequence (the first is prefill's)")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8", help="comma-separated batch sizes")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and activations")
    p.add_argument(
        "--weight-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="keep granite-jax's weights in this dtype instead (bfloat16 with --dtype float32: float32 arithmetic on "
        "bfloat16 weights; transformers reads the same values; None: --dtype)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=2, help="timed runs per measurement, after a warm-up (best kept)"
    )
    p.add_argument("--skip-transformers", action="store_true", help="measure granite-jax only")
    p.add_argument(
        "--floor-pairs",
        type=int,
        default=5,
        help="with batch 1: batch-1 runs each between two sustained reads of the bytes its decode read; the median "
        "and lowest ratio over the steady pairs are printed beside the burst floor (0: none)",
    )
    p.add_argument(
        "--probe-mib", type=int, default=1024, help="size of each memory-bandwidth probe's buffer, in MiB (the floor)"
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH ('-': stdout)")
    p.add_argument(
        "--plot", metavar="PATH", default=None, help="with --floor-pairs: draw the pairs over time into this PNG"
    )
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error(f"need --new-tokens >= 2 (the first token is prefill's; decode times the rest), got {args.new_tokens}")
    if args.floor_pairs < 0:
        p.error(f"need --floor-pairs >= 0, got {args.floor_pairs}")
    if args.checkpoint and args.layers is not None:
        p.error("--layers applies to random weights (--shape) only")
    if args.probe_mib < 1:
        p.error(f"--probe-mib must be >= 1, got {args.probe_mib}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if (problem := output_file_problem(flag, path)) is not None:
            p.error(problem)
    if args.plot and not (args.floor_pairs and 1 in args.batch_sizes):
        p.error("--plot draws the batch-1 floor pairs: it needs batch 1 in --batch-sizes and --floor-pairs >= 1")
    if args.plot == "-":
        p.error("--plot needs a file name")
    return args


def measure(spec, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per (implementation, batch) and the floor, all measured in this process."""
    from granite_jax import compare
    from granite_jax.experiments.throughput import best_bandwidth, decode_floor, memory_bandwidth, paired_floor

    if args.skip_transformers:
        pair = compare.Pair(
            spec.load(dtype=args.dtype, weight_dtype=args.weight_dtype), None, args.dtype, spec.describe()
        )
    else:
        pair = compare.load_pair(spec, dtype=args.dtype, weight_dtype=args.weight_dtype)
    probe_bytes = args.probe_mib << 20
    before = memory_bandwidth(probe_bytes)
    rows = []
    for batch in tqdm(args.batch_sizes, desc="benchmark", unit="batch", file=sys.stderr, disable=None):
        (s,) = compare.speed(pair, (batch,), args.prompt_len, args.new_tokens, args.repeats)
        for impl, key in (("granite-jax", "jax"), ("transformers", "hf")):
            if key in s:
                t = s[key]
                rows.append(
                    dict(
                        impl=impl,
                        batch=batch,
                        prefill_tok_s=t["prefill_tokens_per_s"],
                        decode_tok_s=t["decode_tokens_per_s"],
                    )
                )
    floor = decode_floor(pair.jax, best_bandwidth(before, memory_bandwidth(probe_bytes)))  # before and after: best
    if 1 in args.batch_sizes and args.floor_pairs:
        read, pairs = floor["bytes_read_per_token"], args.floor_pairs
        floor["paired"] = paired_floor(pair.generator, read, args.prompt_len, args.new_tokens, pairs, probe_bytes)
    return sorted(rows, key=lambda r: (r["impl"] != "granite-jax", r["batch"])), floor


# ---------------------------------------------------------------------------------------------- report


def table(rows: list[dict[str, Any]], floor_tok_s: float) -> str:
    lines = [
        "| implementation | batch | prefill tok/s | decode tok/s | vs transformers | batch-1 decode vs floor (burst) |",
        "|---|---|---|---|---|---|",
    ]
    hf = {r["batch"]: r["decode_tok_s"] for r in rows if r["impl"] == "transformers"}
    for r in rows:
        decode = r["decode_tok_s"]
        speedup = f"{decode / hf[r['batch']]:.2f}x" if r["impl"] != "transformers" and r["batch"] in hf else ""
        of_floor = f"{decode / floor_tok_s:.0%}" if r["batch"] == 1 else ""
        cells = [r["impl"], r["batch"], f"{r['prefill_tok_s']:.1f}", f"{decode:.2f}", speedup, of_floor]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from granite_jax.errors import InputError
    from granite_jax.experiments.common import ModelSpec, environment

    spec = ModelSpec(checkpoint=args.checkpoint, name=args.shape, num_layers=args.layers)
    try:
        rows, floor = measure(spec, args)
    except InputError as e:
        print(f"throughput.py: error: {e}", file=sys.stderr)
        return 2
    env = environment()
    bandwidth, floor_tok_s = floor["bandwidth_gb_s"], floor["decode_floor_tok_s"]
    header = (
        f"model: {spec.describe()} ({floor['param_bytes'] / 1e9:.2f} GB of {args.weight_dtype or args.dtype} "
        f"parameters, {args.dtype} arithmetic); prompt "
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens; jax {jax.__version__} on {os.cpu_count()} CPU cores\n"
        f"memory bandwidth: {max(bandwidth.values()):.2f} GB/s (best of "
        + ", ".join(f"{k} {v:.2f}" for k, v in bandwidth.items())
        + f"); batch-1 decode floor (bytes read per token / bandwidth): {floor_tok_s:.2f} tok/s\n"
        f"kernels: {env['kernels']}"
    )
    if "paired" in floor:
        p = floor["paired"]
        header += "\nbatch-1 decode vs the floor of two sustained reads of the same bytes around it: " + ", ".join(
            f"{d:.2f} / {f:.2f} tok/s = {r:.0%}{'' if ok else ' (bandwidth moved)'}"
            for d, f, r, ok in zip(
                p["decode_tok_s"], p["sustained_floor_tok_s"], p["decode_vs_sustained_floors"], p["steady"], strict=True
            )
        )
        if p["steady_pairs"]:
            header += (
                f"; over the {p['steady_pairs']} steady pairs: median {p['decode_vs_sustained_floor']:.0%}, "
                f"lowest {p['decode_vs_sustained_floor_min']:.0%}"
            )
        else:
            header += "; no steady pair: the host's bandwidth moved during every one"
        header += (
            f"; all {len(p['steady'])} pairs pooled (no threshold): {p['decode_vs_pooled_floor']:.0%} of "
            f"{p['pooled_floor_tok_s']:.2f} tok/s"
        )
    print(header)
    print(table(rows, floor_tok_s))
    if args.json:
        doc = dict(
            model=spec.describe(),
            args={k: v for k, v in vars(args).items() if k != "json"},
            **floor,
            rows=rows,
            environment=env,
        )
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.plot:
        from granite_jax.experiments.throughput import plot_pairs

        plot_pairs(floor["paired"], floor["bytes_read_per_token"], max(bandwidth.values()), spec.describe(), args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
