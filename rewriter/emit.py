"""Emitting a planned contraction: slice and squeeze the operands, contract them pairwise along the planned path
(dot_general where labels are contracted), then scale, broadcast and cast to the dtype the original `reduce_sum`
produced.

The result is the original's up to rounding wherever the original's products and partial sums are finite. The
order of operations changes (scalars and signs are applied after the sum, bf16/f16 products accumulate in float32),
so where the original overflows, or multiplies an infinity by zero, the two may differ in which values are inf or
NaN; `rewrite(..., verify=True)` reports such a difference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from rewriter.cost import Plan
from rewriter.pattern import Contraction, Label, Operand

try:  # keeps a weak-typed sum weak, so scan carries and cond branches keep their exact types
    from jax._src.lax.lax import _convert_element_type as _convert_weak
except ImportError:  # pragma: no cover - private API moved
    _convert_weak = None


def operand_value(op: Operand, read: Callable[[Any], Any]) -> jax.Array:
    """The operand with its unlabelled dims (size 1, or constant along them) removed."""
    x = jnp.asarray(read(op.atom))
    shape = op.atom.aval.shape
    if all(d is not None for d in op.dims):
        return x
    limits = tuple(1 if d is None else n for d, n in zip(op.dims, shape))
    if limits != tuple(shape):
        x = lax.slice(x, (0,) * len(shape), limits)
    return lax.reshape(x, tuple(n for d, n in zip(op.dims, shape) if d is not None))


def accumulation_dtype(dtypes: list[Any]) -> Any:
    """bf16/f16 operands accumulate in float32; wider floats (operands or a widened sum) in their own precision."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def contract(c: Contraction, plan: Plan, read: Callable[[Any], Any], out_aval: Any, precision: Any) -> jax.Array:
    """The value of the site's reduce_sum, computed as `c` along `plan.path`."""
    values = [operand_value(op, read) for op in c.operands]
    acc = accumulation_dtype([v.dtype for v in values] + [out_aval.dtype])
    y = pairwise(list(zip(values, (op.labels for op in c.operands))), plan.path, c.kept, precision, acc)
    if c.scale != 1:
        y = y * jnp.asarray(c.scale, acc)
    for s in c.scalars:
        value = operand_value(s, read).reshape(()).astype(acc)
        y = y / value if s.divisor else y * value
    if c.sign < 0:
        y = -y
    kept = set(c.kept)
    positions = tuple(i for i, label in enumerate(c.out) if label in kept)
    if y.shape != tuple(out_aval.shape):
        y = lax.broadcast_in_dim(y, tuple(out_aval.shape), positions)
    y = _laid_out_as(y, out_aval)
    if getattr(out_aval, "weak_type", False) and _convert_weak is not None:
        return _convert_weak(y, out_aval.dtype, weak_type=True)
    return y.astype(out_aval.dtype)


def _laid_out_as(y: jax.Array, out_aval: Any) -> jax.Array:
    """y resharded to the original sum's sharding where the types carry shardings (Explicit axes) and they differ:
    the equations after the site were traced for that type."""
    want = getattr(out_aval, "sharding", None)
    if _mesh_spec(y) is None or want is None or jax.typeof(y).sharding.spec == want.spec:
        return y
    return jax.sharding.reshard(y, want.spec)


Labelled = tuple[jax.Array, tuple[Label, ...]]


def pairwise(operands: list[Labelled], path, out: tuple[Label, ...], precision: Any, acc: Any) -> jax.Array:
    """Contract labelled operands two at a time along `path` (opt_einsum convention), giving labels `out`."""
    operands = list(operands)
    for pair in path:
        taken = [operands.pop(i) for i in sorted(pair, reverse=True)]
        rest = set(out).union(*(labels for _, labels in operands))
        if len(taken) == 1:
            operands.append(presum(*taken[0], rest, acc))
        else:
            operands.append(product(taken[1], taken[0], rest, precision, acc))
    (y, labels), *_ = operands
    y, labels = presum(y, labels, set(out), acc)
    return lax.transpose(y, tuple(labels.index(label) for label in out)) if labels != tuple(out) else y


def presum(x: jax.Array, labels: tuple[Label, ...], needed: set[Label], acc: Any) -> Labelled:
    """Sum out the labels nobody else needs."""
    axes = tuple(i for i, label in enumerate(labels) if label not in needed)
    if not axes:
        return x, labels
    return jnp.sum(x.astype(acc), axis=axes), tuple(label for label in labels if label in needed)


def product(lhs: Labelled, rhs: Labelled, rest: set[Label], precision: Any, acc: Any) -> Labelled:
    """One pairwise step: a dot_general when labels are contracted, else a broadcasting multiply."""
    (a, la), (b, lb) = presum(*lhs, rest | set(rhs[1]), acc), presum(*rhs, rest | set(lhs[1]), acc)
    dtype = jnp.promote_types(a.dtype, b.dtype)
    a, b = a.astype(dtype), b.astype(dtype)
    batch = tuple(label for label in la if label in lb and label in rest)
    contracted = tuple(label for label in la if label in lb and label not in rest)
    if not contracted:  # a Hadamard or outer product: a dot_general with K=1 would be a slow GEMM
        labels = la + tuple(label for label in lb if label not in la)
        shape = tuple((a.shape[la.index(label)] if label in la else b.shape[lb.index(label)]) for label in labels)
        return expand(a.astype(acc), la, labels, shape) * expand(b.astype(acc), lb, labels, shape), labels
    dims = (
        (tuple(la.index(label) for label in contracted), tuple(lb.index(label) for label in contracted)),
        (tuple(la.index(label) for label in batch), tuple(lb.index(label) for label in batch)),
    )
    free = lambda mine, other: tuple(label for label in mine if label not in other)
    labels = batch + free(la, lb) + free(lb, la)
    sharding = explicit_out_sharding((a, la), (b, lb), contracted, labels)
    y = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc, out_sharding=sharding)
    return y, labels


def _mesh_spec(x: jax.Array) -> tuple[Any, tuple] | None:
    """(mesh, spec) of x's type when it is sharded over Explicit mesh axes (sharding in types), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return None
    return mesh, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))


def explicit_out_sharding(lhs: Labelled, rhs: Labelled, contracted: tuple, labels: tuple) -> Any:
    """Under Explicit axes, a product whose contracted labels both operands shard is ambiguous to JAX: its output
    keeps each label's mesh axes from the operand that has the label (the first for batch labels), each mesh axis
    once. None otherwise (JAX infers it)."""
    found = [_mesh_spec(x) for x, _ in (lhs, rhs)]
    if None in found:
        return None
    specs = [dict(zip(names, spec)) for (_, names), (_, spec) in zip((lhs, rhs), found)]
    if not any(specs[0].get(label) and specs[1].get(label) for label in contracted):
        return None
    used, out = set(), []
    for label in labels:
        entry = specs[0].get(label) if label in specs[0] else specs[1].get(label)
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes = tuple(axis for axis in axes if axis not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return jax.sharding.NamedSharding(found[0][0], jax.sharding.PartitionSpec(*out))


def expand(x: jax.Array, labels: tuple[Label, ...], target: tuple[Label, ...], shape: tuple[int, ...]) -> jax.Array:
    """x (dims labelled `labels`) transposed into `target` order and broadcast to `shape`."""
    order = sorted(range(len(labels)), key=lambda i: target.index(labels[i]))
    if order != list(range(len(labels))):
        x = lax.transpose(x, tuple(order))
    return lax.broadcast_in_dim(x, shape, tuple(sorted(target.index(label) for label in labels)))
