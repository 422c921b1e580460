"""`python -m granite_jax.memory`: the device memory a Granite 4.0 model needs to serve `sessions` sequences of up to
`context` tokens, predicted part by part (`plan.predict`), the largest context or session count that fits a given
capacity (`plan.fit`), and, with --measure, the memory a run takes on this machine next to the prediction."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from granite_jax import cli
from granite_jax.config import ModelConfig
from granite_jax.errors import InputError

PROG = "python -m granite_jax.memory"
DTYPES = {  # --dtype -> (arithmetic, weights)
    "bfloat16": (jnp.bfloat16, jnp.bfloat16),
    "float32": (jnp.float32, jnp.float32),
    "float8": (jnp.bfloat16, jnp.float8_e4m3fn),
}
# Contexts count tokens, whose lengths are powers of two: K and M are binary (128K = 131072).
TOKEN_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20}
BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
GB = 1e9

PARTS_HELP = """parts:
  weights      the model's parameters as granite-jax holds them (float8 weights with their scales), exact
  kv_cache     the attention layers' keys and values: sessions x context slots each, exact; 0 without attention
  mamba_state  each Mamba layer's conv ring and float32 SSM state per session, exact; independent of the context
  activations  estimated peak of the buffers a prefill segment of --prefill-chunk tokens for all sessions holds at
               once (residual stream, last logits, the largest layer's working set; on a CPU computing in bfloat16,
               XLA's float32 copies of the weights)
  total        their sum
GB is 10^9 bytes. With --measure, the cache is measured as one part (kv_cache + mamba_state)."""


def token_count(text: str) -> int:
    """argparse type: a token count >= 1, with an optional binary suffix K or M (128K = 131072)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a positive integer, optionally with K or M (128K), got {text!r}")
    value = int(m.group(1)) * TOKEN_SUFFIXES[m.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def token_counts(text: str) -> list[int]:
    """argparse type: comma-separated token counts ("4096,128K")."""
    return [token_count(part) for part in text.split(",")]


def byte_count(text: str) -> int:
    """argparse type: a capacity with a unit, decimal (141GB = 141e9 bytes) or binary (GiB); bytes without one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 141GB, 80GiB, 512MB or 1TB, got {text!r}")
    value = int(float(m.group(1)) * BYTE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog=PROG,
        description="Predict the device memory of a Granite 4.0 model serving SESSIONS sequences of up to CONTEXT "
        "tokens each, part by part, without allocating it; find the largest context or session count that fits a "
        "capacity (--fit); measure a run on this machine next to the prediction (--measure).",
        epilog=PARTS_HELP + "\n\nExamples:\n"
        f"  {PROG} --config h-tiny --context 8192,128K --sessions 1,8,64\n"
        f"  {PROG} --config h-small --dtype float8 --fit 141GB --context 128K --sessions 1,16\n"
        f"  {PROG} --model ckpt/granite-4.0-h-350m --context 4096 --json plan.json\n"
        f"  {PROG} --config h-350m --dtype float32 --context 4096,32768 --measure\n\n"
        "Exit status: 0 on success, 2 on invalid input.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--config",
        metavar="NAME",
        help="a released architecture, e.g. h-tiny or granite-4.0-h-tiny (any of granite_jax.presets.RELEASED), "
        "or tiny (the test suite's)",
    )
    which.add_argument(
        "--model",
        metavar="DIR",
        help="a checkpoint directory (Hugging Face GraniteMoeHybrid or its orbax conversion): its config.json; "
        "--measure loads its weights",
    )
    p.add_argument(
        "--context",
        type=token_counts,
        default=[4096],
        metavar="T[,T...]",
        help="KV-cache slots per session: prompt plus generated tokens; comma list, K/M suffixes binary (128K = "
        "131072). Default: 4096",
    )
    p.add_argument(
        "--sessions",
        type=cli.positive_ints,
        default=[1],
        metavar="N[,N...]",
        help="sequences served at once (the batch); comma list. Default: 1",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="bfloat16 or float32: weights and arithmetic both; float8: float8 (e4m3) weights with per-channel "
        "scales, bfloat16 arithmetic. Default: bfloat16",
    )
    p.add_argument(
        "--prefill-chunk",
        type=cli.positive_int,
        default=512,
        metavar="N",
        help="prompt tokens prefilled per call for every session at once (sizes the activations). Default: 512",
    )
    p.add_argument(
        "--platform",
        choices=("gpu", "cpu"),
        help="the device predicted for: on a CPU, XLA widens bfloat16 weights to float32 copies for its products. "
        "Default: the platform JAX runs on here",
    )
    p.add_argument(
        "--fit",
        type=byte_count,
        metavar="SIZE",
        help="device capacity (141GB = 141e9 bytes; GiB, MB, TB, ... too): print the largest context that fits for "
        "each --sessions and the most sessions that fit for each --context",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write the numbers, in bytes, as JSON to FILE (- for standard output, instead of the tables)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run each (context, sessions) on this machine's default device: random weights of --config (or "
        "--model's weights), one prefill segment of --prefill-chunk random tokens per session and a few decode "
        "steps with a cache of exactly CONTEXT slots; print the memory each part took next to the prediction. "
        "GPU: the allocator's statistics; CPU: the process's resident memory, compilation excluded (see "
        "granite_jax/memory/measure.py)",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="with --measure: run the platform's kernel backend (on CPUs granite_jax.cpu) rather than plain XLA, "
        "which the prediction describes; arrays it derives from the weights are reported as 'prepared'",
    )
    return p


# ---------------------------------------------------------------------------------------------- the model


def model_config(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    """(name, config) of --config or --model."""
    if args.model is not None:
        from granite_jax.checkpoint import load_config

        return args.model, load_config(args.model)
    from granite_jax.experiments.common import model_config as named_config

    if args.config.endswith(".py"):
        raise InputError(f"--config {args.config}: give the name of a released architecture, not a file")
    return args.config, named_config(args.config)


def default_platform() -> str:
    return "cpu" if jax.default_backend() == "cpu" else "gpu"


# ---------------------------------------------------------------------------------------------- prediction


def plans(cfg: ModelConfig, args: argparse.Namespace) -> list:
    from granite_jax.memory.plan import predict

    return [predict(cfg, context=t, sessions=n, **predict_options(args)) for t, n in combinations(args)]


def combinations(args: argparse.Namespace) -> list[tuple[int, int]]:
    return list(itertools.product(args.context, args.sessions))


def predict_options(args: argparse.Namespace) -> dict[str, Any]:
    dtype, weights = DTYPES[args.dtype]
    return dict(dtype=dtype, weight_dtype=weights, prefill_chunk=args.prefill_chunk, platform=args.platform)


def gigabytes(n: int | None) -> str:
    return "" if n is None else f"{n / GB:.3f}"


def plan_table(found: list) -> str:
    """One row per part, one column per (context, sessions)."""
    from granite_jax.experiments.common import markdown_table
    from granite_jax.memory.plan import PARTS

    header = "GB (context × sessions)"
    columns = [header] + [f"{p.context} × {p.sessions}" for p in found]
    rows = [{header: part} | {c: gigabytes(getattr(p, part)) for c, p in zip(columns[1:], found)} for part in PARTS]
    rows.append({header: "total"} | {c: gigabytes(p.total) for c, p in zip(columns[1:], found)})
    return markdown_table(rows, columns)


def fits(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, list[dict[str, int]]]:
    """The largest context fitting --fit for each --sessions, and the most sessions for each --context (0: none)."""
    from granite_jax.memory.plan import fit

    options = predict_options(args)
    return dict(
        largest_context=[dict(sessions=n, context=fit(cfg, args.fit, sessions=n, **options)) for n in args.sessions],
        most_sessions=[dict(context=t, sessions=fit(cfg, args.fit, context=t, **options)) for t in args.context],
    )


def fit_lines(found: dict[str, list[dict[str, int]]], capacity: int) -> str:
    lines = [f"In {capacity / GB:.3f} GB ({capacity} bytes):"]
    lines += [f"  {f['sessions']} session(s): context up to {f['context']} tokens" for f in found["largest_context"]]
    lines += [f"  context {f['context']}: up to {f['sessions']} session(s)" for f in found["most_sessions"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- measurement


def measurements(cfg: ModelConfig, args: argparse.Namespace, found: list) -> list:
    from granite_jax.memory.measure import measure_runs
    from granite_jax.ops import Runtime
    from granite_jax.system import free_memory

    if args.platform != default_platform():
        raise InputError(f"--measure runs on this machine's {default_platform()}; drop --platform {args.platform}")
    free, need = free_memory(), max(p.total for p in found)
    if free is not None and need > free:
        raise InputError(f"--measure: the prediction ({need / GB:.2f} GB) exceeds the {free / GB:.2f} GB free here")
    dtype, weights = DTYPES[args.dtype]
    runtime = Runtime(kernels=args.kernels)
    if args.model is not None:
        from granite_jax.checkpoint import load_model

        weights_name = "float8" if args.dtype == "float8" else args.dtype
        dtype_name = "bfloat16" if args.dtype == "float8" else args.dtype
        make = lambda: load_model(args.model, dtype=dtype_name, weight_dtype=weights_name, runtime=runtime)  # noqa: E731
        return measure_runs(make, combinations(args), prefill_chunk=args.prefill_chunk)
    from granite_jax.experiments.common import random_model

    def make(c: ModelConfig = cfg):
        return random_model(c, dtype=dtype, param_dtype=weights, runtime=runtime)

    # One layer of each kind first: the small programs creating random weights compile then, not during the count.
    warm = lambda: make(cfg.replace(layer_types=tuple(dict.fromkeys(cfg.layer_types))))  # noqa: E731
    return measure_runs(make, combinations(args), prefill_chunk=args.prefill_chunk, warm_up=warm)


def measured_rows(found: list, measured: list) -> list[dict[str, Any]]:
    """Per (context, sessions) and part: predicted and measured GB and their ratio."""
    rows = []
    for p, m in zip(found, measured):
        pairs = [
            ("weights", p.weights, m.weights),
            ("cache", p.kv_cache + p.mamba_state, m.cache),
            ("activations", p.activations, m.activations),
        ]
        if m.prepared:
            pairs.append(("prepared (kernels)", 0, m.prepared))
        pairs.append(("total", p.total, m.total))
        for part, predicted, got in pairs:
            ratio = "" if got is None or not predicted else f"{got / predicted:.3f}"
            rows.append(
                dict(
                    context=p.context,
                    sessions=p.sessions,
                    part=part,
                    predicted_GB=gigabytes(predicted),
                    measured_GB=gigabytes(got),
                    measured_over_predicted=ratio,
                )
            )
    return rows


# ---------------------------------------------------------------------------------------------- output


def heading(name: str, args: argparse.Namespace) -> str:
    dtype = "float8 weights, bfloat16 arithmetic" if args.dtype == "float8" else f"{args.dtype} weights and arithmetic"
    return f"{name}: {dtype}, prefill chunk {args.prefill_chunk}, platform {args.platform}\n"


def report(name: str, args: argparse.Namespace, found: list, fitted, measured) -> dict[str, Any]:
    return dict(
        model=name,
        dtype=args.dtype,
        platform=args.platform,
        prefill_chunk=args.prefill_chunk,
        predicted=[p.as_dict() for p in found],
        fit=None if fitted is None else dict(capacity=args.fit, **fitted),
        measured=None if measured is None else [m.as_dict() for m in measured],
    )


def run_cli(args: argparse.Namespace) -> int:
    problem = cli.output_file_problem("--json", args.json)
    if problem is not None:
        raise InputError(problem)
    args.platform = args.platform or default_platform()
    name, cfg = model_config(args)
    found = plans(cfg, args)
    fitted = fits(cfg, args) if args.fit is not None else None
    quiet = args.json == "-"  # standard output holds the JSON alone
    if not quiet:
        print(heading(name, args) + "\n" + plan_table(found), end="")
        if fitted is not None:
            print("\n" + fit_lines(fitted, args.fit), end="")
    measured = measurements(cfg, args, found) if args.measure else None
    if measured is not None and not quiet:
        from granite_jax.experiments.common import markdown_table

        print(
            f"\nMeasured on {measured[0].platform} ({measured[0].how}):\n"
            + markdown_table(measured_rows(found, measured)),
            end="",
        )
    if args.json is not None:
        write(args.json, report(name, args, found, fitted, measured))
    return 0


def write(path: str, obj: dict[str, Any]) -> None:
    if path == "-":
        json.dump(obj, sys.stdout, indent=2)
        print()
        return
    from granite_jax.experiments.common import write_json

    write_json(os.fspath(path), obj)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # --measure runs for minutes on a large model and writes nothing until the end: Ctrl-C loses nothing
    return cli.guarded("granite_jax.memory", lambda: run_cli(args))


if __name__ == "__main__":
    sys.exit(main())
