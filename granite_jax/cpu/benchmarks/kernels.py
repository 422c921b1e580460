"""The CPU kernels (`granite_jax.cpu`) against XLA on this CPU, for a released model's decode shapes.

    python granite_jax/cpu/benchmarks/kernels.py                      # h-350m's shapes, 1-16 rows
    python granite_jax/cpu/benchmarks/kernels.py --rows 8 --json out.json
    python granite_jax/cpu/benchmarks/kernels.py --dtype bfloat16 --parts products  # bfloat16 weights

Products: for every distinct (out, in) weight shape of the model (and the tied head), a jitted chain of products
against enough different weight matrices to overflow the caches, so each product reads its weights from memory as in
a decode step (one row: the matrix-vector kernel and XLA both read the checkpoint's (out, in) layout; 2-16 rows: the
kernel reads them packed in panels, `packing.pack`, XLA the (out, in) layout). Prints GB/s of weights read.
State update: one token through every Mamba layer's state (batch = rows, `ssd.ssd_step`), GB/s of state read and
written by the update (the kernel's one pass; XLA reads the state a second time for y). Mamba step: the same token
through every Mamba layer's whole decoding step between its projections (`MambaMixer.mix`: conv, time steps, state
update, gated norm; one kernel call a layer, against XLA's fusions), microseconds per layer. Experts (MoE shapes only,
e.g. --shape granite-4.0-h-tiny): the (token, expert) rows of --expert-tokens tokens (a decode batch, or a prefill)
through one layer's stacked expert weights, in and out, each call with other random expert ids (`expert_linear`); GB/s
of the distinct chosen experts' weights and GFLOP/s (the kernel reads each chosen expert in place, once for all its
rows; XLA gathers them first, or past 64 rows groups the rows by expert for one `lax.ragged_dot`). Attention: one query
token per row over a KV cache (`attend_cache`). --dtype sets the weights' and activations' dtype of the products and
experts (the state is always float32). The model's ops run as the kernels (`Runtime()`) and as plain JAX
(`Runtime(kernels=False)`: XLA), the products as the kernels' own calls against XLA's; both are timed alternately in
one run, best of --repeats, and the ratio printed. Weights and activations are uniform random numbers (`uniform`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)  # runs from a plain checkout


PARTS = ("products", "state", "mamba", "experts", "attention")


def runtimes() -> dict:
    """How each side runs the model's ops: "kernel", the CPU kernels (the default `Runtime`); "xla", plain JAX."""
    from granite_jax.ops import Runtime

    return {"kernel": Runtime(), "xla": Runtime(kernels=False)}


def parts(text: str) -> list[str]:
    """argparse type: a comma-separated subset of PARTS."""
    chosen = text.split(",")
    if not set(chosen) <= set(PARTS):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(PARTS)}, got {text!r}")
    return chosen


def parse_args(argv=None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, add_shape_argument, output_file_problem, positive_int, positive_ints

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_shape_argument(p, "weight shapes")
    p.add_argument(
        "--rows", type=positive_ints, default="1,2,4,8,16", help="comma-separated rows of x (the decode batch size)"
    )
    p.add_argument(
        "--expert-tokens",
        type=positive_ints,
        default="1,2,4,8,128",
        help="comma-separated tokens through the experts (decode, prefill)",
    )
    p.add_argument(
        "--contexts",
        type=positive_ints,
        default="256,4096,32768",
        help="comma-separated filled KV-cache slots for the attention part",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and activations")
    p.add_argument(
        "--chain-mib", type=positive_int, default=192, help="weights read per timed call, MiB (beyond the caches)"
    )
    p.add_argument("--repeats", type=positive_int, default=5, help="timed calls per measurement (best kept)")
    p.add_argument(
        "--parts",
        type=parts,
        default="products,state,mamba,experts,attention",
        help="comma-separated: products, state (update), mamba (the mixer's decoding step between its projections), "
        "experts (MoE), attention (decode, over the KV cache)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    if max(args.rows) > 16:
        p.error(f"argument --rows: the kernels take 1-16 rows, got {max(args.rows)}")
    if (problem := output_file_problem("--json", args.json)) is not None:
        p.error(problem)
    return args


def weight_shapes(name: str) -> list[tuple[int, int]]:
    """Distinct (out, in) shapes of the model's Linear weights and its output head."""
    from flax import nnx

    from granite_jax.model import Granite, Linear, abstract_model
    from granite_jax.presets import released_config

    cfg = released_config(name)
    model: Granite = abstract_model(cfg)
    shapes = {tuple(m.weight.shape) for _, m in nnx.iter_graph(model) if isinstance(m, Linear)}
    shapes.add((cfg.vocab_size, cfg.hidden_size))
    return sorted(shapes)


def measure(shape: tuple[int, int], rows: int, chain_bytes: int, repeats: int, dtype: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from granite_jax import ops
    from granite_jax.cpu import kernels, packing
    from granite_jax.model import linear
    from granite_jax.ops import Runtime

    n, k = shape
    size = jnp.dtype(dtype).itemsize
    count = max(1, -(-chain_bytes // (n * k * size)))
    weights = [random_array((n, k), dtype, seed=i) for i in range(count)]
    x = random_array((rows, k), dtype, seed=-1)
    if rows == 1:  # the matrix-vector kernel, on the weights as they are
        kernel = jax.jit(lambda x, ws: sum(kernels.matvec(x, w) for w in ws))
        operands = weights
    else:  # the panel kernel, on the panels `packing.prepare` keeps beside each weight for such steps
        kernel = jax.jit(lambda x, ps: sum(kernels.panels(x, p, n) for p in ps))
        operands = [packing.pack(w) for w in weights]
    xla = jax.jit(ops.under(Runtime(kernels=False), lambda x, ws: sum(linear(x, w) for w in ws)))  # the model's product
    calls = {"kernel": functools.partial(kernel, x, operands), "xla": functools.partial(xla, x, weights)}
    best = best_times(calls, repeats)
    read = count * n * k * size
    return dict(
        out=n,
        inp=k,
        rows=rows,
        matrices=count,
        **rates(read, best),
    )


def uniform(shape: tuple[int, ...], dtype: str, seed: int = 0):
    """Values in [-1, 1) of `shape` on the device, drawn under `seed` (>= -1). What the kernels read is timed, not its
    values: uniform draws cost a fifth of normal ones, and the largest (the tied head, the experts) are 10^8 values."""
    import jax.numpy as jnp
    import numpy as np

    x = np.random.default_rng(seed + 1).random(shape, np.float32)
    x *= 2
    x -= 1
    return jnp.asarray(x, dtype)


random_array = functools.lru_cache(maxsize=4)(uniform)  # the same weights for the next rows or tokens


def best_times(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Best wall time of each call after a warm-up one, calls alternated so that all see the same machine."""
    import jax

    for call in calls.values():
        jax.block_until_ready(call())
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def rates(nbytes: int, best: dict[str, float]) -> dict[str, float]:
    """GB/s of kernel and XLA over `nbytes` moved in their best times, and the kernel's speed-up."""
    return dict(
        kernel_gb_s=nbytes / best["kernel"] / 1e9,
        xla_gb_s=nbytes / best["xla"] / 1e9,
        kernel_vs_xla=best["xla"] / best["kernel"],
    )


def measure_state_update(name: str, batch: int, repeats: int) -> dict[str, Any]:
    """One token through every Mamba layer's state at this batch size (`ssd.ssd_step`): kernel vs XLA."""
    import jax
    import numpy as np

    from granite_jax import ops
    from granite_jax.presets import released_config
    from granite_jax.ssd import ssd_step

    cfg = released_config(name)
    layers = sum(kind == "mamba" for kind in cfg.layer_types)
    h, p, n, g = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups
    rng = np.random.default_rng(0)
    states = [jax.device_put(rng.standard_normal((batch, h, p, n), np.float32)) for _ in range(layers)]
    x = jax.device_put(rng.standard_normal((batch, h, p), np.float32))
    dt = jax.device_put(rng.uniform(0.01, 0.1, (batch, h)).astype(np.float32))
    A = jax.device_put(-rng.uniform(1.0, 8.0, h).astype(np.float32))
    B, C = (jax.device_put(rng.standard_normal((batch, g, n), np.float32)) for _ in range(2))
    D = jax.device_put(rng.standard_normal(h).astype(np.float32))

    def chain(runtime):  # the states donated and returned, updated in place as in a decode step
        return jax.jit(ops.under(runtime, lambda ss, *a: [ssd_step(s, *a)[1] for s in ss]), donate_argnums=0)

    fns = {impl: chain(runtime) for impl, runtime in runtimes().items()}
    carried = {name: [jax.numpy.array(s) for s in states] for name in fns}  # own copies: each chain donates its own

    def step(name):  # one call, its new states carried into the next
        carried[name] = jax.block_until_ready(fns[name](carried[name], x, dt, A, B, C, D))

    best = best_times({name: functools.partial(step, name) for name in fns}, repeats)
    moved = 2 * layers * batch * h * p * n * 4  # the state read and written once
    return dict(
        batch=batch,
        layers=layers,
        state_shape=[batch, h, p, n],
        **rates(moved, best),
    )


def measure_mamba_step(name: str, batch: int, repeats: int) -> dict[str, Any]:
    """One token through every Mamba layer's decoding step between its projections (`MambaMixer.mix`) at this batch
    size: the fused kernel (`kernels.mamba_step`) vs XLA's. Every layer has the one mixer's weights (random)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from granite_jax import ops
    from granite_jax.model import MambaState
    from granite_jax.presets import released_config

    cfg = released_config(name)
    layers = sum(kind == "mamba" for kind in cfg.layer_types)
    h, p, n = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state
    rng = np.random.default_rng(0)
    normal = lambda *shape: jax.device_put(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    graphdef, weights = nnx.split(mamba_mixer(name))
    zxbcdt = normal(batch, 1, cfg.mamba_d_inner + cfg.mamba_conv_dim + h)
    rings = [normal(batch, cfg.mamba_d_conv, cfg.mamba_conv_dim) for _ in range(layers)]
    states = [normal(batch, h, p, n) for _ in range(layers)]
    mask, slot = jnp.ones((batch, 1), jnp.bool_), jnp.int32(7)  # decoding: every row real

    def chain(runtime):  # rings and states donated and returned, updated in place as in a decode step
        def layers_of(weights, rings, states):
            mixer = nnx.merge(graphdef, weights)
            outs = [mixer.mix(zxbcdt, mask, MambaState(r, s), slot) for r, s in zip(rings, states, strict=True)]
            return [y for y, _ in outs], [o.conv for _, o in outs], [o.ssm for _, o in outs]

        return jax.jit(ops.under(runtime, layers_of), donate_argnums=(1, 2))

    fns = {impl: chain(runtime) for impl, runtime in runtimes().items()}
    carried = {name: ([jnp.array(r) for r in rings], [jnp.array(s) for s in states]) for name in fns}

    def step(name):  # one call, its new rings and states carried into the next
        _, new_rings, new_states = jax.block_until_ready(fns[name](weights, *carried[name]))
        carried[name] = (new_rings, new_states)

    best = best_times({name: functools.partial(step, name) for name in fns}, repeats)
    return dict(
        batch=batch,
        layers=layers,
        kernel_us_per_layer=best["kernel"] / layers * 1e6,
        xla_us_per_layer=best["xla"] / layers * 1e6,
        kernel_vs_xla=best["xla"] / best["kernel"],
    )


@functools.lru_cache(maxsize=1)  # one for every batch size
def mamba_mixer(name: str):
    """A Mamba mixer of the released model `name`, every weight `uniform` (Flax's initialisers cost seconds here)."""
    import jax
    from flax import nnx

    from granite_jax.model import MambaMixer
    from granite_jax.presets import released_config

    graphdef, state = nnx.split(nnx.eval_shape(lambda: MambaMixer(released_config(name), rngs=nnx.Rngs(0))))
    leaves, treedef = jax.tree.flatten(state)
    weights = [uniform(x.shape, x.dtype, seed) for seed, x in enumerate(leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))


def measure_experts(name: str, tokens: int, chain_bytes: int, repeats: int, dtype: str) -> list[dict[str, Any]]:
    """The expert products of one MoE layer for this many tokens (tokens x experts-per-token rows), in and out."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from granite_jax import ops
    from granite_jax.model import expert_linear
    from granite_jax.presets import released_config

    cfg = released_config(name)
    E, k, H, F = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size
    rng = np.random.default_rng(0)
    rows, out, size = tokens * k, [], jnp.dtype(dtype).itemsize
    for K, N in ((H, 2 * F), (F, H)):  # input_linear (E, H, 2F), output_linear (E, F, H)
        w, x = random_array((E, K, N), dtype), random_array((rows, K), dtype, seed=-1)
        count = max(1, -(-chain_bytes // (min(rows, E) * K * N * size)))
        ids = [np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]).reshape(-1) for _ in range(count)]
        distinct = sum(len(np.unique(e)) for e in ids)
        ids = [jax.device_put(e.astype(np.int32)) for e in ids]
        fns = {
            impl: jax.jit(ops.under(runtime, lambda x, w, ids: sum(expert_linear(x, w, e) for e in ids)))
            for impl, runtime in runtimes().items()
        }
        calls = {impl: functools.partial(fn, x, w, ids) for impl, fn in fns.items()}
        best = best_times(calls, repeats)
        flops = 2 * count * rows * K * N
        gflop_s = {f"{impl}_gflop_s": flops / best[impl] / 1e9 for impl in ("kernel", "xla")}
        shape = dict(tokens=tokens, rows=rows, experts=E, inp=K, out=N)
        out.append(dict(**shape, **rates(distinct * K * N * size, best), **gflop_s))
    return out


def measure_attention(name: str, rows: int, context: int, chain_bytes: int, repeats: int) -> dict[str, Any]:
    """One query token per row over `context` filled slots of one attention layer's float32 KV cache (the float32
    model's), through enough layers' caches to overflow the CPU's (`model.attend_cache`): the kernel vs XLA's
    online-softmax blocks."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from granite_jax import model, ops
    from granite_jax.presets import released_config

    cfg = released_config(name)
    kv, hd = cfg.num_key_value_heads, cfg.head_dim
    rep, scale = cfg.num_attention_heads // kv, cfg.attention_multiplier
    layer_bytes = 2 * rows * kv * context * hd * 4
    count = max(1, -(-chain_bytes // layer_bytes))
    rng = np.random.default_rng(0)
    caches = [
        model.KVState(*(jax.device_put(rng.standard_normal((rows, kv, context, hd), np.float32)) for _ in range(2)))
        for _ in range(count)
    ]
    q = jax.device_put(rng.standard_normal((rows, 1, kv, rep, hd), np.float32))
    slot, pad = jnp.array([context - 1], jnp.int32), jnp.zeros((rows,), jnp.int32)

    def layers(q, caches, slot, pad):  # every cache, the positions rebuilt inside (a Positions is not a jit argument)
        return sum(model.attend_cache(q, c, model.Positions(slot, pad), scale) for c in caches)

    fns = {impl: jax.jit(ops.under(runtime, layers)) for impl, runtime in runtimes().items()}
    calls = {impl: functools.partial(fn, q, caches, slot, pad) for impl, fn in fns.items()}
    best = best_times(calls, repeats)
    return dict(
        rows=rows,
        context=context,
        layers=count,
        kv_heads=kv,
        queries_per_kv=rep,
        head_dim=hd,
        **rates(count * layer_bytes, best),
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    from granite_jax import cpu

    if not cpu.available():
        print(f"error: the kernels are not available here: {cpu.unavailable_reason()}", file=sys.stderr)
        return 2
    results, updates, mamba, experts, attention = [], [], [], [], []
    if "products" in args.parts:
        work = [(s, r) for s in weight_shapes(args.shape) for r in args.rows]
        results = [
            measure(s, r, args.chain_mib << 20, args.repeats, args.dtype)
            for s, r in tqdm(work, desc="products", unit="shape", file=sys.stderr, disable=None)
        ]
        print(
            f"{args.shape} weight shapes, {args.dtype}; GB/s of weights read (kernel: 1 row on W, 2-16 rows on W's "
            "panels)"
        )
        print("| W (out x in) | rows | kernel GB/s | XLA GB/s | kernel / XLA |")
        print("|---|---|---|---|---|")
        for r in results:
            print(
                f"| {r['out']} x {r['inp']} | {r['rows']} | {r['kernel_gb_s']:.1f} | {r['xla_gb_s']:.1f} | "
                f"{r['kernel_vs_xla']:.2f}x |"
            )
    if "state" in args.parts:
        updates = [
            measure_state_update(args.shape, r, args.repeats)
            for r in tqdm(args.rows, desc="state update", unit="batch", file=sys.stderr, disable=None)
        ]
        print(f"\n{args.shape} Mamba state update, one token through all {updates[0]['layers']} layers; GB/s of state")
        print("| batch | state (b, h, p, n) | kernel GB/s | XLA GB/s | kernel / XLA |")
        print("|---|---|---|---|---|")
        for r in updates:
            shape = ", ".join(map(str, r["state_shape"]))
            rates = f"{r['kernel_gb_s']:.1f} | {r['xla_gb_s']:.1f} | {r['kernel_vs_xla']:.2f}x"
            print(f"| {r['batch']} | ({shape}) | {rates} |")
    if "mamba" in args.parts:
        mamba = [
            measure_mamba_step(args.shape, r, args.repeats)
            for r in tqdm(args.rows, desc="mamba step", unit="batch", file=sys.stderr, disable=None)
        ]
        print(
            f"\n{args.shape} Mamba decoding step between the projections, one token through all "
            f"{mamba[0]['layers']} layers; microseconds per layer"
        )
        print("| batch | kernel us | XLA us | kernel / XLA |")
        print("|---|---|---|---|")
        for r in mamba:
            times = f"{r['kernel_us_per_layer']:.1f} | {r['xla_us_per_layer']:.1f} | {r['kernel_vs_xla']:.2f}x"
            print(f"| {r['batch']} | {times} |")
    if "experts" in args.parts:
        from granite_jax.presets import released_config

        if released_config(args.shape).num_local_experts == 0:
            print(f"\n{args.shape} has no routed experts (try --shape granite-4.0-h-tiny)")
        else:
            for t in tqdm(args.expert_tokens, desc="experts", unit="size", file=sys.stderr, disable=None):
                experts += measure_experts(args.shape, t, args.chain_mib << 20, args.repeats, args.dtype)
            print(
                f"\n{args.shape} expert products of one layer, {args.dtype}; GB/s of the distinct chosen experts' "
                "weights, GFLOP/s"
            )
            print(
                "| tokens | rows | W (experts x in x out) | kernel GB/s | XLA GB/s | kernel GFLOP/s | XLA GFLOP/s |"
                " kernel / XLA |"
            )
            print("|---|---|---|---|---|---|---|---|")
            for r in experts:
                rates = f"{r['kernel_gb_s']:.1f} | {r['xla_gb_s']:.1f} | {r['kernel_gflop_s']:.1f} | "
                rates += f"{r['xla_gflop_s']:.1f} | {r['kernel_vs_xla']:.2f}x"
                print(f"| {r['tokens']} | {r['rows']} | {r['experts']} x {r['inp']} x {r['out']} | {rates} |")
    if "attention" in args.parts:  # every released architecture has attention layers
        work = [(r, c) for c in args.contexts for r in args.rows]
        attention = [
            measure_attention(args.shape, r, c, args.chain_mib << 20, args.repeats)
            for r, c in tqdm(work, desc="attention", unit="size", file=sys.stderr, disable=None)
        ]
        print(f"\n{args.shape} decode attention over float32 KV caches (past the CPU caches); GB/s of keys and values")
        print("| batch | filled slots | kernel GB/s | XLA GB/s | kernel / XLA |")
        print("|---|---|---|---|---|")
        for r in attention:
            rates = f"{r['kernel_gb_s']:.1f} | {r['xla_gb_s']:.1f} | {r['kernel_vs_xla']:.2f}x"
            print(f"| {r['rows']} | {r['context']} | {rates} |")
    if args.json:
        from granite_jax.experiments.common import environment, write_json

        doc = dict(
            args=vars(args),
            results=results,
            state_update=updates,
            mamba_step=mamba,
            experts=experts,
            attention=attention,
            environment=environment(),
        )
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
