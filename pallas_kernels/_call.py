"""Where the kernels may run, and the one `pallas_call` wrapper every kernel goes through.

The kernels use Pallas's Triton lowering (`compiler_params=CompilerParams(...)` from `jax.experimental.pallas.triton`).
They run on an NVIDIA GPU. Anywhere else a call raises `PallasUnavailableError` unless a test opted in:

- `interpret_mode()`: run them with `interpret=True` (Pallas's HLO interpreter, on CPU), and by default poison every
  kernel output with NaN (an integer one with its least value) before the kernel runs, so an element the kernel never
  writes comes out as NaN;
- `cuda_lowering()`: trace them for the CUDA platform on a machine without a GPU, for
  `jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))` checks. What is lowered this way cannot run here.

Both modes are read when a function is traced: enter the context before the first call of any `jax.jit` function that
should see it (jit caches do not know about the mode).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


class PallasUnavailableError(RuntimeError):
    """A Pallas kernel was called where it cannot run (no NVIDIA GPU and no test mode)."""


@dataclasses.dataclass(frozen=True)
class _Mode:
    interpret: bool = False
    poison_outputs: bool = False
    cuda_lowering: bool = False


_DEFAULT_MODE = _Mode()
_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar("pallas_kernels_mode", default=None)


@contextlib.contextmanager
def interpret_mode(*, poison_outputs: bool = True) -> Iterator[None]:
    """Run the kernels interpreted on CPU (tests only: slow, and no Triton-lowering checks).

    With `poison_outputs` every kernel output starts as NaN, so an unwritten element fails any comparison.
    """
    token = _MODE.set(_Mode(interpret=True, poison_outputs=poison_outputs))
    try:
        yield
    finally:
        _MODE.reset(token)


@contextlib.contextmanager
def cuda_lowering() -> Iterator[None]:
    """Trace the kernels for CUDA on a machine without a GPU, to check that they lower; the result cannot run here."""
    token = _MODE.set(_Mode(cuda_lowering=True))
    try:
        yield
    finally:
        _MODE.reset(token)


def interpreting() -> bool:
    """Whether kernels traced now run interpreted (inside `interpret_mode()`)."""
    return (_MODE.get() or _DEFAULT_MODE).interpret


def check_available() -> None:
    """Raise `PallasUnavailableError` unless the kernels can run here: on an NVIDIA GPU, or inside `interpret_mode()`
    or `cuda_lowering()`. Commands call it before loading a model, so a wrong choice fails at once."""
    _check_platform(_MODE.get() or _DEFAULT_MODE)


def _check_platform(mode: _Mode) -> None:
    if mode.interpret or mode.cuda_lowering:
        return
    backend = jax.default_backend()
    if backend != "gpu":
        raise PallasUnavailableError(
            f"ssd_impl='pallas' needs an NVIDIA GPU; use 'xla' on {backend.upper()} "
            "(tests run the kernels interpreted inside `pallas_kernels.interpret_mode()`)"
        )


def call(
    kernel: Callable[..., None],
    *,
    name: str,
    grid: tuple[int, ...],
    in_specs: Sequence[pl.BlockSpec],
    out_specs: Sequence[pl.BlockSpec],
    out_shape: Sequence[jax.ShapeDtypeStruct],
    num_warps: int,
    num_stages: int,
    input_output_aliases: dict[int, int] | None = None,
) -> Callable[..., tuple[jax.Array, ...]]:
    """`pl.pallas_call` with Triton compiler params, the platform check and (in interpret mode) NaN-poisoned outputs.

    Poisoning passes a NaN-filled array for every output not already aliased to an input, aliased to that output, so
    the kernel starts from NaN exactly where it would start from uninitialised memory on the GPU.
    """
    mode = _MODE.get() or _DEFAULT_MODE
    _check_platform(mode)
    aliases = dict(input_output_aliases or {})
    n_in, n_out = len(in_specs), len(out_specs)
    poisoned = [i for i in range(n_out) if i not in aliases.values()] if mode.poison_outputs else []

    def body(*refs):
        inputs, outputs = refs[:n_in], refs[n_in + len(poisoned) :]
        kernel(*inputs, *outputs)

    for j, i in enumerate(poisoned):
        aliases[n_in + j] = i
    fn = pl.pallas_call(
        body,
        out_shape=tuple(out_shape),
        grid=grid,
        in_specs=[*in_specs, *(out_specs[i] for i in poisoned)],
        out_specs=tuple(out_specs),
        input_output_aliases=aliases,
        interpret=mode.interpret,
        name=name,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )

    def run(*args: jax.Array) -> tuple[jax.Array, ...]:
        poison = [jnp.full(out_shape[i].shape, _poison(out_shape[i].dtype), out_shape[i].dtype) for i in poisoned]
        return fn(*args, *poison)

    return run


def _poison(dtype) -> float | int:
    """What an unwritten output element holds in interpret mode: NaN, or for integers their least value."""
    return jnp.nan if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min
