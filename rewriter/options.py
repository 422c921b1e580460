"""Options of the rewriter: the profitability gate, the dot precision, chain fusion and verification."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax import lax

PRECISIONS = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH, "default": lax.Precision.DEFAULT}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """How `rewrite` and `analyze` treat each broadcast-multiply-sum site.

    min_flops: skip sites whose rewritten contraction costs fewer FLOPs than this (XLA fuses small ones well).
    min_dim: skip sites whose main contraction has K, or its smaller free side, below this. None picks it for the
        default backend: 16 on GPU/TPU, where XLA turns smaller dots back into reductions, and 2 on CPU, where
        XLA's dots beat its fused reductions even at K = 2 (docs/rewriter.md, "Profitability gate").
    precision: precision of the emitted dots. "auto" (default) is full float32 (`Precision.HIGHEST`, never TF32)
        unless the user set `jax.default_matmul_precision`, which is then respected. "highest", "high", "default",
        a `lax.Precision`, a `lax.DotAlgorithmPreset` or None (JAX's default) opt into faster modes.
    fuse_chains: compose a site with the single-use site feeding it (product, mask, product) into one contraction
        when the cost model says the fused contraction needs fewer FLOPs.
    verify: on the first call, run the original and the rewritten function and raise `VerificationError`, naming
        the site, if they differ beyond `rtol`/`atol` (scaled by the largest reference magnitude).
    rtol, atol: verification tolerances; None picks them from the output dtype (see `tolerance`).
    """

    min_flops: float = 1e6
    min_dim: int | None = None
    precision: Any = "auto"
    fuse_chains: bool = True
    verify: bool = False
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self):
        if not _is_finite_number(self.min_flops) or self.min_flops < 0:
            raise ValueError(f"min_flops must be a finite number >= 0, got {self.min_flops!r}")
        if self.min_dim is not None and (
            not isinstance(self.min_dim, int) or isinstance(self.min_dim, bool) or self.min_dim < 1
        ):
            raise ValueError(f"min_dim must be None or an int >= 1, got {self.min_dim!r}")
        for name in ("fuse_chains", "verify"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__}: {value!r}")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and (not _is_finite_number(value) or value < 0):
                raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}")
        dot_precision(self.precision)  # validates

    def gate_min_dim(self) -> int:
        if self.min_dim is not None:
            return self.min_dim
        return 2 if jax.default_backend() == "cpu" else 16

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Options:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown rewriter option(s) {unknown}; valid options are {sorted(names)}")
        return cls(**kwargs)


def _is_finite_number(x: Any) -> bool:
    """A real, finite int or float (bools, NaN and infinities are not)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))


def dot_precision(precision: Any) -> Any:
    """The `precision=` argument for the emitted dots."""
    if precision == "auto":
        user_set = jax.config.jax_default_matmul_precision is not None
        return None if user_set else lax.Precision.HIGHEST
    if precision is None or isinstance(precision, lax.Precision | lax.DotAlgorithmPreset):
        return precision
    if isinstance(precision, str) and precision.lower() in PRECISIONS:
        return PRECISIONS[precision.lower()]
    raise ValueError(
        f"precision must be 'auto', one of {sorted(PRECISIONS)}, None, a lax.Precision or a lax.DotAlgorithmPreset; "
        f"got {precision!r}"
    )


def tolerance(dtype: Any, options: Options) -> tuple[float, float]:
    """(rtol, atol) for comparing a rewritten output of this dtype with the original, relative to its max |value|."""
    bits = jax.numpy.finfo(dtype).nmant if jax.numpy.issubdtype(dtype, jax.numpy.inexact) else 52
    rtol = options.rtol if options.rtol is not None else (1e-4 if bits >= 23 else 3e-2)
    atol = options.atol if options.atol is not None else (1e-6 if bits >= 23 else 1e-3)
    return rtol, atol
