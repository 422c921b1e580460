"""Peak host memory while loading a checkpoint straight into its shards over a mesh, beside loading it onto one
device, from safetensors and from orbax.

    python benchmarks/sharded_loading.py                          # a random ~270M-parameter hybrid, made here
    python benchmarks/sharded_loading.py --model DIR --mesh data=2,model=4 --json OUT.json

Each load runs in a fresh interpreter with 8 simulated CPU devices. Measured there: the resident memory's peak
(VmHWM, reset after the imports and the mesh) above the resident memory before the load, beside the model's bytes
and its shards' bytes on all devices (over data=2 the weights are held twice, once per data row). On CPU devices the
shards are host memory too, so a load that holds the model once peaks at about 1.0x its shards' bytes plus the
largest tensor in flight: 2x would mean a whole second copy (all the tensors read first, a memory-mapped file, the
model built on one device and then split, a check that copies every weight). On a GPU the shards are device memory,
and the host holds one tensor at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 8
# A hybrid of ~270M parameters (1 GB in float32): big enough that the model dominates the interpreter's own memory.
CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    layer_types=["mamba", "mamba", "mamba", "attention"] * 2,
    num_attention_heads=16,
    num_key_value_heads=8,
    mamba_n_heads=32,
    mamba_d_head=64,
    mamba_d_state=64,
    intermediate_size=512,
    shared_intermediate_size=1024,
    num_local_experts=16,
    num_experts_per_tok=4,
)

CHILD = r"""
import json, os, sys
from granite_jax.memory.measure import RssMeter
from granite_jax import sharding
from granite_jax.checkpoint import load_model
import jax
mesh = None if sys.argv[2] == "none" else sharding.parse_mesh(sys.argv[2])
meter = RssMeter()
before = meter.in_use()
meter.reset_peak()
model = load_model(sys.argv[1], mesh=mesh)
peak = meter.peak()
from flax import nnx
leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
shards = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
print(json.dumps(dict(peak_above=peak - before, model_bytes=sum(x.nbytes for x in leaves), shard_bytes=shards,
                      largest_tensor=max(x.nbytes for x in leaves))))
"""


def parse_args(argv=None) -> argparse.Namespace:
    sys.path.insert(0, ROOT)  # runs from a plain checkout
    from granite_jax.cli import ArgumentParser, model_dir, output_file_problem

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--model",
        type=model_dir,
        default=None,
        help="Hugging Face checkpoint directory (default: a random one, made here)",
    )
    p.add_argument("--mesh", default="data=2,model=4", help=f"the mesh over {DEVICES} simulated CPU devices")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if problem := output_file_problem("--json", args.json):
        p.fail(problem)
    return args


def measured_load(model: str, mesh: str) -> dict:
    """One load in a fresh interpreter with the simulated devices: its peak memory and the model's bytes."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", CHILD, model, mesh], capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode != 0:
        sys.exit(f"sharded_loading.py: error: the load over {mesh} failed: {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    from granite_jax.checkpoint import load_model, save_checkpoint
    from granite_jax.testing import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = args.model or make_checkpoint(os.path.join(tmp, "hf"), 0, **CONFIG)
        orbax_dir = save_checkpoint(load_model(hf_dir), os.path.join(tmp, "orbax"))
        rows = []
        print(f"{'source':<12} {'mesh':<16} {'model MB':>8} {'shards MB':>9} {'peak MB':>8} {'peak/shards':>11}")
        for source, path in (("safetensors", hf_dir), ("orbax", orbax_dir)):
            for mesh in ("none", args.mesh):
                r = dict(source=source, mesh=mesh, **measured_load(path, mesh))
                r["peak_over_shards"] = r["peak_above"] / r["shard_bytes"]
                rows.append(r)
                mb = lambda n: n / 2**20  # noqa: E731
                print(
                    f"{source:<12} {mesh:<16} {mb(r['model_bytes']):>8.0f} {mb(r['shard_bytes']):>9.0f} "
                    f"{mb(r['peak_above']):>8.0f} {r['peak_over_shards']:>10.2f}x"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(devices=DEVICES, config=None if args.model else CONFIG, loads=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
