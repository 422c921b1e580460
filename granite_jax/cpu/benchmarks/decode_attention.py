"""Decode steps with and without the CPU decode-attention kernel, in one process, interleaved.

    python granite_jax/cpu/benchmarks/decode_attention.py            # h-350m's shape, 8K-token context, batch 1
    python granite_jax/cpu/benchmarks/decode_attention.py --prompt-len 256 --weight-dtype float32 --json out.json

Two Generators over one random-weight model (float32 arithmetic on --weight-dtype weights) compile the decode step
for the same prompt: one with the kernel (`kernels.decode_attention`, the CPU backend's `model.attend_cache`), the
other with XLA's online-softmax blocks (the plain `model.attend_cache`: the backend's implementation of that one op
is set aside while the second step is traced, every other kernel stays). The prompt is prefilled once, and each
steps its own copy of that cache; then every round times --steps decode steps of each in the order kernel, XLA, XLA,
kernel, and takes XLA's two times over the kernel's: the machine's drift within a round weighs on both alike. Each
step adds a slot to the context, the same number for both. Prints each round and the median (with --json, a JSON
document).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)  # runs from a plain checkout

ATTENTION_TARGET = "granite_decode_attention"  # the kernel's FFI target (`kernels.decode_attention`)


def parse_args(argv=None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, output_file_problem, positive_int
    from granite_jax.presets import RELEASED

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    names = [*sorted(RELEASED), "tiny"]
    p.add_argument(
        "--shape",
        default="granite-4.0-h-350m",
        choices=names,
        metavar="NAME",
        help="random weights of this architecture: a released one, or tiny (the tests' 4-layer model, to check the "
        "script in seconds): " + ", ".join(names),
    )
    p.add_argument("--layers", type=positive_int, default=None, help="N layers, same share of attention (None: all)")
    p.add_argument("--weight-dtype", choices=("float32", "bfloat16"), default="bfloat16", help="weights' dtype")
    p.add_argument("--prompt-len", type=positive_int, default=8192, help="prompt tokens per row: the filled context")
    p.add_argument("--batch", type=positive_int, default=1, help="rows decoded at once")
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps per timing")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds of (kernel, XLA, XLA, kernel) timings")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    if (problem := output_file_problem("--json", args.json)) is not None:
        p.error(problem)
    return args


@contextlib.contextmanager
def attention_by_xla() -> Iterator[None]:
    """Steps traced inside run XLA's online-softmax blocks for decode attention (the plain `model.attend_cache`): the
    CPU backend's implementation of that op is set aside meanwhile, its other kernels stay."""
    from granite_jax import model, ops
    from granite_jax.cpu import backend

    impls = ops.backend(backend.NAME).impls
    op = model.attend_cache.__qualname__
    kept = impls.pop(op)
    try:
        yield
    finally:
        impls[op] = kept


class Prefilled:
    """`prompts` prefilled by `generator` for `steps` decode steps after the first token: the first tokens and the
    cache, and what a decode step takes besides them."""

    def __init__(self, generator, prompts: list[list[int]], steps: int):
        from granite_jax.sampling import SamplingConfig

        sampling = SamplingConfig(max_new_tokens=steps + 1, stop_token_ids=())
        self.params = sampling.device_params()
        layout = generator.layout([len(p) for p in prompts], sampling.max_new_tokens)
        self.room = layout.max_new_tokens - 1  # fewer where a RoPE model's positions end first
        self.prepared = generator.prepared(layout.batch_size)
        _, self.tokens, self.cache = generator.prefill(prompts, layout, self.params)


class Decoder:
    """A Generator's decode step, compiled now, stepping its own copy of a prefilled cache: each step adds one slot to
    the context, and the cache holds `prefilled.room` of them."""

    def __init__(self, generator, prefilled: Prefilled):
        import jax
        import jax.numpy as jnp

        self.taken, self.room, self.params = 0, prefilled.room, prefilled.params
        self.weights, self.prepared = generator.steps.weights, prefilled.prepared
        self.tokens, self.cache = prefilled.tokens, jax.tree.map(jnp.copy, prefilled.cache)  # each step donates it
        # Traced and compiled here, by a jit of its own (the Generator's are shared by models of one structure), so
        # that what runs is what was traced now, under the op implementations now set (`uses_kernel` reads it).
        from flax import nnx

        from granite_jax.generation.steps import decode_step

        treedef = jax.tree.structure(nnx.state(generator.steps.model))
        decode = jax.jit(
            functools.partial(decode_step, nnx.graphdef(generator.steps.model), treedef), donate_argnums=(2,)
        )
        args = (self.weights, self.prepared, self.cache, self.tokens, self.params, np.int32(0))
        self.step = decode.lower(*args).compile()
        self.uses_kernel = ATTENTION_TARGET in self.step.as_text()

    def seconds_per_step(self, steps: int) -> float:
        """Mean wall time of `steps` steps queued back to back (the tokens read once, at the end)."""
        assert self.taken + steps <= self.room, "the cache was sized for fewer steps"
        start = time.perf_counter()
        for _ in range(steps):
            self.taken += 1
            _, self.tokens, self.cache = self.step(
                self.weights, self.prepared, self.cache, self.tokens, self.params, np.int32(self.taken)
            )
        self.tokens.block_until_ready()
        return (time.perf_counter() - start) / steps


def interleaved(kernel: Callable[[], float], xla: Callable[[], float], rounds: int) -> list[dict[str, float]]:
    """Rounds of kernel, XLA, XLA, kernel: a drift within a round weighs on both alike, and both decoders take the same
    steps, so their contexts grow alike."""
    out = []
    for _ in tqdm(range(rounds), desc="rounds", unit="round", file=sys.stderr, disable=None):
        k1, x1, x2, k2 = kernel(), xla(), xla(), kernel()
        out.append(dict(kernel_s=(k1 + k2) / 2, xla_s=(x1 + x2) / 2, xla_over_kernel=(x1 + x2) / (k1 + k2)))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from granite_jax import cpu
    from granite_jax.experiments.common import ModelSpec, environment, write_json
    from granite_jax.generation import Generator

    if not cpu.available():
        print(f"error: the kernels are not available here: {cpu.unavailable_reason()}", file=sys.stderr)
        return 2
    spec = ModelSpec(None, args.shape, args.layers, 0)
    model = spec.load(dtype="float32", weight_dtype=args.weight_dtype)
    prompts = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    total = 2 + 2 * args.rounds * args.steps  # each decoder's steps: a warm-up and two timings a round
    generator = Generator(model=model, tokenizer=None)
    prefilled = Prefilled(generator, prompts, total)
    kernel = Decoder(generator, prefilled)
    with attention_by_xla():
        xla = Decoder(Generator(model=model, tokenizer=None), prefilled)
    if not kernel.uses_kernel or xla.uses_kernel:  # what is compared must be what was compiled
        print("error: the kernel's step does not call it, or the XLA step does", file=sys.stderr)
        return 1
    for decoder in (kernel, xla):  # warm up
        decoder.seconds_per_step(2)
    rounds = interleaved(
        lambda: kernel.seconds_per_step(args.steps), lambda: xla.seconds_per_step(args.steps), args.rounds
    )
    ratios = [r["xla_over_kernel"] for r in rounds]
    print(
        f"{spec.describe()}, {args.weight_dtype} weights (float32 arithmetic); batch {args.batch}, "
        f"{args.prompt_len}-token context; {args.steps} decode steps per timing"
    )
    print("| round | kernel ms/step | XLA ms/step | XLA / kernel |")
    print("|---|---|---|---|")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {r['kernel_s'] * 1e3:.2f} | {r['xla_s'] * 1e3:.2f} | {r['xla_over_kernel']:.3f} |")
    print(f"median XLA / kernel step time: {np.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    if args.json:
        doc: dict[str, Any] = dict(
            args=vars(args),
            model=spec.describe(),
            rounds=rounds,
            median_xla_over_kernel=float(np.median(ratios)),
            environment=environment(),
        )
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
