"""Granite over several H200s on paper: each device's bytes, FLOPs and collective bytes per step, and the step's
predicted time, read from the programs XLA's GPU compiler makes for a mesh of compile-only H200s (no GPU needed).

    PYTHONPATH=.aot python benchmarks/mesh_plan.py                      # h-small over 1, 2, 4 and 8 H200s
    PYTHONPATH=.aot python benchmarks/mesh_plan.py --shape granite-4.0-h-tiny --devices 1,2 --steps decode-b1

Each step is the Generator's own (`granite_jax.generation.steps`) over a `model=N` mesh (`granite_jax.sharding`:
heads, experts, vocabulary and widths split N ways, the Mamba rows in N blocks, the experts under the mesh backend's
shard_map), its weights, caches and tokens placed as the Generator places them, compiled for N compile-only H200s
(`pallas_kernels.aot.gpu_devices`). Every device runs the same program; its launches (`pallas_kernels.executable`)
give the per-device bytes and FLOPs, each kernel predicted at max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s) as in
gpu_report.py, and its collectives the bytes each device sends over NVLink (a ring all-reduce of S bytes over N
devices: 2 (N-1)/N S) at 900 GB/s. Predicted step: kernels + collectives, not overlapped (in a decode step each
all-reduce waits for the product before it and holds up the one after). Over a mesh the platform kernels and the
Pallas SSD are off, as the Generator runs it, so the 1-device column is that program too.

Layers are measured as in gpu_report.py: models of two and three layers, their difference one layer of each kind,
scaled to the shape's layer counts. With one GPU, only the 1-device column can be held to a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a plain checkout

STEPS = {"decode-b1": ("decode", 1, 1), "decode-b64": ("decode", 64, 1), "prefill-8192": ("prefill", 1, 8192)}
TOTALS = ("kernels", "bytes", "flops", "predicted_s", "collectives", "collective_bytes", "collective_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, add_shape_argument, output_file_problem, positive_int

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_shape_argument(p, "the weights and dimensions", default="granite-4.0-h-small")
    p.add_argument("--devices", default="1,2,4,8", help="comma-separated mesh sizes (the model axis)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    p.add_argument("--cache-len", type=positive_int, default=8192, help="decode steps' KV cache slots")
    p.add_argument("--json", metavar="PATH", help="also write everything as JSON to PATH")
    args = p.parse_args(argv)
    try:
        devices = [int(n) for n in args.devices.split(",") if n.strip()]
    except ValueError:
        devices = []
    if not devices or not all(1 <= n <= 8 for n in devices):
        p.fail(f"--devices {args.devices!r}: expected comma-separated sizes from 1 to 8, e.g. 1,2,4,8")
    args.devices = devices
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    if unknown := [s for s in args.steps if s not in STEPS]:
        p.fail(f"--steps: unknown step {unknown[0]!r}; expected some of {', '.join(STEPS)}")
    if (problem := output_file_problem("--json", args.json)) is not None:
        p.fail(problem)
    return args


def step_totals(cfg, devices: int, step: str, cache_len: int) -> dict[str, float]:
    """Per-device totals of one run of `step` for the model `cfg` over `devices` compile-only H200s."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh

    import pallas_kernels
    from granite_jax.generation.steps import abstract_steps
    from granite_jax.ops import Runtime
    from pallas_kernels import aot, executable

    kind, batch, tokens = STEPS[step]
    mesh = Mesh(np.asarray(aot.gpu_devices(devices)), ("model",), axis_types=(AxisType.Auto,))
    fns = abstract_steps(cfg, batch=batch, prompt_len=tokens, cache_len=max(cache_len, tokens), dtype=jnp.bfloat16,
                         weight_dtype=jnp.bfloat16, runtime=Runtime(platform="gpu"), mesh=mesh)  # fmt: skip
    fn, fn_args = fns[kind]
    with pallas_kernels.cuda_lowering():  # the cache donated, as the Generator does
        totals = executable.summary(executable.launches(aot.lower_for_gpu(fn, fn_args, donate_argnums=(2,))))
    return {k: float(totals[k]) for k in TOTALS}


def whole_model(cfg, devices: int, step: str, cache_len: int) -> dict[str, Any]:
    """The step's per-device totals for all of `cfg`'s layers, from models of two and three layers
    (`executable.layer_split`), and the split itself."""
    from pallas_kernels.executable import layer_split

    parts = layer_split(cfg, lambda c: step_totals(c, devices, step, cache_len))
    counts = {f"{kind} layer": cfg.layer_types.count(kind) for kind in set(cfg.layer_types)} | {"rest": 1}
    total = {k: sum(counts[part] * values[k] for part, values in parts.items()) for k in TOTALS}
    return dict(total=total, parts=parts)


def table(result: dict[str, Any]) -> str:
    lines = [
        "| step | H200s | GB / device | GFLOP / device | collectives | collective MB / device | kernels ms | "
        "collectives ms | predicted ms | vs 1 device |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for step, by_devices in result["steps"].items():
        one = by_devices.get("1", {}).get("total", {}).get("predicted_s")
        for n, r in by_devices.items():
            t = r["total"]
            kernels_s = t["predicted_s"] - t["collective_s"]
            speedup = f"{one / t['predicted_s']:.2f}x" if one else "-"
            lines.append(
                f"| {step} | {n} | {t['bytes'] / 1e9:.2f} | {t['flops'] / 1e9:.0f} | {t['collectives']:.0f} | "
                f"{t['collective_bytes'] / 1e6:.2f} | {kernels_s * 1e3:.2f} | {t['collective_s'] * 1e3:.3f} | "
                f"{t['predicted_s'] * 1e3:.2f} | {speedup} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from granite_jax.errors import InputError
    from granite_jax.presets import released_config
    from pallas_kernels import aot

    try:
        aot.gpu_devices(max(args.devices))
    except aot.AotUnavailableError as e:
        print(f"mesh_plan.py: error: {e}; run with PYTHONPATH=.aot after `make test` has installed it",
              file=sys.stderr)  # fmt: skip
        return 2
    cfg = released_config(args.shape)
    start = time.perf_counter()
    steps: dict[str, dict[str, Any]] = {}
    for step in args.steps:
        steps[step] = {}
        for n in args.devices:
            print(f"compiling {step} of {args.shape} over {n} H200(s)...", file=sys.stderr)
            try:
                steps[step][str(n)] = whole_model(cfg, n, step, args.cache_len)
            except InputError as e:  # a mesh that does not divide the model
                print(f"mesh_plan.py: error: {e}", file=sys.stderr)
                return 2
    result = dict(
        command="python benchmarks/mesh_plan.py " + " ".join(sys.argv[1:] if argv is None else argv),
        jax=jax.__version__,
        shape=args.shape,
        mamba_layers=cfg.layer_types.count("mamba"),
        attention_layers=cfg.layer_types.count("attention"),
        cache_len=args.cache_len,
        steps=steps,
        seconds=time.perf_counter() - start,
    )
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
