"""Public entry points: `rewrite(fn, **options)` and `analyze(fn, *args)`."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from rewriter.interpret import Context, eval_jaxpr
from rewriter.options import Options, dot_precision, tolerance
from rewriter.plan import JaxprPlan, Planner
from rewriter.site import REWRITTEN, Report, Site


class VerificationError(AssertionError):
    """The rewritten function disagrees with the original beyond tolerance (raised by `rewrite(fn, verify=True)`)."""


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct | jax.core.Tracer)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """x's type with everything the trace may depend on: shape, dtype, weak type, sharding (under a mesh, ops pick
    their output shardings and collectives from their operands'), varying manual axes."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    like = jax.ShapeDtypeStruct.like(x)
    return jax.ShapeDtypeStruct(like.shape, like.dtype, weak_type=jax.typeof(x).weak_type, sharding=like.sharding)


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


@dataclasses.dataclass
class _Signature:
    """How a call's arguments split into traced arrays and static (hashable, closed-over) values."""

    treedef: Any
    dynamic: tuple[int, ...]
    static: tuple[tuple[int, Any], ...]

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> tuple[_Signature, list]:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = tuple(i for i, x in enumerate(leaves) if _is_array(x))
        static = tuple((i, x) for i, x in enumerate(leaves) if not _is_array(x))
        for i, x in static:
            try:
                hash(x)
            except TypeError:
                raise TypeError(
                    f"argument leaf {i} ({type(x).__name__}) is neither an array nor hashable; rewrite treats "
                    "non-array arguments as static values"
                ) from None
        return cls(treedef, dynamic, static), [leaves[i] for i in dynamic]

    def key(self) -> tuple:
        # With the types: 1, 1.0 and True hash equal but trace differently (as jax.jit's static arguments do).
        return (self.treedef, self.dynamic, tuple((i, type(x), x) for i, x in self.static))

    def bind(self, fn: Callable) -> Callable:
        """fn as a function of the dynamic leaves only."""

        def flat(*values):
            leaves = [None] * (len(self.dynamic) + len(self.static))
            for i, x in zip(self.dynamic, values):
                leaves[i] = x
            for i, x in self.static:
                leaves[i] = x
            args, kwargs = jax.tree.unflatten(self.treedef, leaves)
            return fn(*args, **kwargs)

        return flat


def _trace(fn: Callable, sig: _Signature, values: list) -> tuple[ClosedJaxpr, Any]:
    closed, out_shape = jax.make_jaxpr(sig.bind(fn), return_shape=True)(*map(_abstract, values))
    return closed, jax.tree.structure(out_shape)


def _plan(closed: ClosedJaxpr, options: Options) -> tuple[JaxprPlan, list[Site]]:
    planner = Planner(options)
    return planner.plan(closed.jaxpr), planner.sites


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"expected a callable to rewrite, got {type(fn).__name__}: {fn!r}")


def _check_options(options: Any) -> None:
    if options is not None and not isinstance(options, Options):
        hint = "; pass options=rewriter.Options(**your_dict)" if isinstance(options, dict) else ""
        raise TypeError(f"options must be a rewriter.Options or None, got {type(options).__name__}: {options!r}{hint}")


def analyze(fn: Callable, *args: Any, options: Options | None = None, **kwargs: Any) -> Report:
    """Report every broadcast-multiply-sum site of `fn(*args, **kwargs)` and what `rewrite` would do with it.

    Arguments may be abstract (`jax.ShapeDtypeStruct`): nothing is allocated or run. Non-array arguments are
    static. Rewriter options are given as `options=Options(...)`; other keywords go to `fn`.
    """
    _check_callable(fn)
    _check_options(options)
    options = Options() if options is None else options
    sig, values = _Signature.of(args, kwargs)
    closed, _ = _trace(fn, sig, values)
    _, sites = _plan(closed, options)
    return Report(_name(fn), sites, dataclasses.asdict(options))


def rewrite(fn: Callable, *, options: Options | None = None, **kwargs: Any) -> Rewritten:
    """`fn` with each profitable broadcast-multiply-sum replaced by a dot_general contraction.

    Keyword options are the fields of `Options` (min_flops, min_dim, precision, fuse_chains, verify, rtol, atol).
    The result is jit-compiled per argument shapes and composes with `jax.jit`, `jax.grad` and `jax.vmap`.
    Array arguments (and ShapeDtypeStructs in `.analyze`) are traced; other arguments are static.
    """
    _check_callable(fn)
    _check_options(options)
    if options is not None and kwargs:
        raise TypeError("pass either options=Options(...) or keyword options, not both")
    return Rewritten(fn, Options.from_kwargs(**kwargs) if options is None else options)


class Rewritten:
    """The callable returned by `rewrite`. `last_report` is the report of the most recent trace."""

    def __init__(self, fn: Callable, options: Options):
        self.fn, self.options = fn, options
        self.last_report: Report | None = None
        self._jitted: dict[tuple, Callable] = {}
        self._verified = False
        self._layouts: dict[tuple, tuple] = {}  # a jitted fn's output shardings, by signature and argument shardings
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn, updated=())

    def __repr__(self) -> str:
        return f"rewrite({_name(self.fn)}, {self.options})"

    def analyze(self, *args: Any, **kwargs: Any) -> Report:
        return analyze(self.fn, *args, options=self.options, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig, values = _Signature.of(args, kwargs)
        layout = self._original_layout(sig, values, args, kwargs)
        if self.options.verify and not self._verified:
            with self._lock:
                if not self._verified:
                    self._verify(sig, values)  # raises on a mismatch, so a failed check is repeated, never skipped
                    self._verified = True
        key = (sig.key(), layout)
        with self._lock:
            jitted = self._jitted.get(key)
            if jitted is None:
                out = {} if layout is None else {"out_shardings": jax.tree.unflatten(layout[0], layout[1])}
                jitted = self._jitted[key] = jax.jit(functools.partial(self._run, sig), **out)
        return jitted(*values)

    def _original_layout(self, sig: _Signature, values: list, args: tuple, kwargs: dict) -> tuple | None:
        """For a jitted `fn` called with concrete arrays: (output treedef, output shardings, None where unspecified),
        after raising what `fn` raises for these arguments. The rewritten program runs `fn`'s jaxpr inside a jit of
        its own, where a nested jit's checks of concrete arguments (in_shardings against committed arrays') and its
        out_shardings do not apply; so `fn` is lowered once per signature and argument shardings, for its errors and
        its output shardings. None for anything else."""
        if not hasattr(self.fn, "lower") or any(isinstance(x, jax.core.Tracer) for x in values):
            return None
        key = (sig.key(), tuple(getattr(x, "sharding", None) for x in values))
        with self._lock:
            if key in self._layouts:
                return self._layouts[key]
        shardings, treedef = jax.tree.flatten(
            jax.tree.map(lambda o: o.sharding, self.fn.lower(*args, **kwargs).out_info), is_leaf=lambda x: x is None
        )
        layout = (treedef, tuple(shardings))
        with self._lock:
            self._layouts[key] = layout
        return layout

    def _run(self, sig: _Signature, *values: Any) -> Any:
        closed, out_tree = _trace(self.fn, sig, list(values))
        plan, sites = _plan(closed, self.options)
        self.last_report = Report(_name(self.fn), sites, dataclasses.asdict(self.options))
        ctx = Context(dot_precision(self.options.precision))
        outs = eval_jaxpr(closed.jaxpr, closed.consts, values, plan, ctx)
        return jax.tree.unflatten(out_tree, outs)

    # ------------------------------------------------------------------------------------------ verification

    def _verify(self, sig: _Signature, values: list) -> None:
        closed, _ = _trace(self.fn, sig, values)
        if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
            msg = f"rewrite({_name(self.fn)}, verify=True): it closes over traced values; not verified"
            warnings.warn(msg, stacklevel=3)
            return
        plan, sites = _plan(closed, self.options)
        rewritten = [s for s in sites if s.status == REWRITTEN]  # none: the re-traced program is compared all the same
        with jax.ensure_compile_time_eval():
            inputs = _concrete_inputs(values)
            reference = jax.jit(jaxpr_as_fun(closed))(*inputs)
            precision = dot_precision(self.options.precision)
            run = lambda enabled: _evaluate(closed, plan, inputs, Context(precision, enabled))
            result = run(lambda site_id: True)
            error = _sharding_mismatch(reference, result) or _mismatch(reference, result, self.options)
            if error is None:
                return
            culprits = []
            for site in rewritten:
                site_error = _mismatch(reference, run(lambda site_id, s=site.id: site_id == s), self.options)
                if site_error is not None:
                    culprits.append((site, site_error))
        if not culprits:
            together = "with all sites rewritten together" if rewritten else "with no site rewritten"
            raise VerificationError(f"rewrite({_name(self.fn)}): output {error}, {together}")
        lines = [f"site #{s.id} {s.spec} at {s.path + ': ' if s.path else ''}{s.source}: {e}" for s, e in culprits]
        raise VerificationError(f"rewrite({_name(self.fn)}) changed the result at:\n  " + "\n  ".join(lines))


def _evaluate(closed: ClosedJaxpr, plan: JaxprPlan, inputs: list, ctx: Context) -> list:
    return jax.jit(lambda *xs: eval_jaxpr(closed.jaxpr, closed.consts, xs, plan, ctx))(*inputs)


def _concrete_inputs(values: list) -> list:
    """The call's arrays, or seeded stand-ins of the same shape when they are abstract or traced."""
    rng = np.random.default_rng(0)
    out = []
    for x in values:
        if not isinstance(x, jax.ShapeDtypeStruct | jax.core.Tracer):
            out.append(x)
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            out.append(_stand_in_keys(x))
            continue
        dtype = np.dtype(x.dtype)
        if np.issubdtype(dtype, np.inexact):
            stand_in = jax.numpy.asarray(rng.standard_normal(x.shape), dtype)
        else:
            stand_in = jax.numpy.zeros(x.shape, dtype)
        sharding = getattr(x, "sharding", None)
        concrete = isinstance(sharding, jax.sharding.Sharding) and not isinstance(
            getattr(sharding, "mesh", None), jax.sharding.AbstractMesh
        )
        out.append(jax.device_put(stand_in, sharding) if concrete else stand_in)  # laid out as the call's would be
    return out


def _stand_in_keys(x: Any) -> jax.Array:
    """Typed PRNG keys of x's shape and key implementation."""
    for impl in (None, "threefry2x32", "rbg", "unsafe_rbg"):
        key = jax.random.key(0, impl=impl)
        if key.dtype == x.dtype:
            return jax.random.split(key, math.prod(x.shape)).reshape(x.shape)
    raise TypeError(f"verify: no stand-in for PRNG keys of dtype {x.dtype}")


def _sharding_mismatch(reference: list, result: list) -> str | None:
    """A description of the first output leaf laid out differently over the devices, or None."""
    for k, (a, b) in enumerate(zip(jax.tree.leaves(reference), jax.tree.leaves(result))):
        arrays = isinstance(a, jax.Array) and isinstance(b, jax.Array)
        if arrays and not a.sharding.is_equivalent_to(b.sharding, a.ndim):
            return f"{k} is sharded as {b.sharding}, the original as {a.sharding}"
    return None


def _mismatch(reference: list, result: list, options: Options) -> str | None:
    """A description of the first output leaf that differs beyond tolerance, or None."""
    for k, (a, b) in enumerate(zip(jax.tree.leaves(reference), jax.tree.leaves(result))):
        if hasattr(a, "dtype") and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
        a64, b64 = np.asarray(a, wide), np.asarray(b, wide)
        if not np.issubdtype(np.asarray(a).dtype, np.inexact):
            if not np.array_equal(a64, b64):
                return f"{k} differs (non-float values)"
            continue
        finite = np.isfinite(a64)
        same_specials = np.array_equal(a64[~finite], b64[~finite], equal_nan=True)
        if not np.array_equal(finite, np.isfinite(b64)) or not same_specials:
            return f"{k} has non-finite values in different places"
        if not finite.any():
            continue
        rtol, atol = tolerance(np.asarray(a).dtype, options)
        err = float(np.max(np.abs(a64 - b64)[finite]))
        scale = float(np.max(np.abs(a64[finite])))
        if err > atol + rtol * scale:
            return f"{k} differs: max |diff| {err:.3g} > atol {atol:g} + rtol {rtol:g} x max |ref| {scale:.3g}"
    return None
