"""Helpers (no tests) for the rewriter tests: independent structural checks on jaxprs and float64 numpy oracles."""

from __future__ import annotations

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Var


def subjaxprs(eqn) -> list[Jaxpr]:
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, Jaxpr):
                found.append(v)
    return found


def all_eqns(jaxpr) -> list:
    """Every equation of a (closed) jaxpr and of the jaxprs nested in its params."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for sub in subjaxprs(eqn):
            out.extend(all_eqns(sub))
    return out


def primitives(jaxpr) -> list[str]:
    return [e.primitive.name for e in all_eqns(jaxpr)]


def sums_of_products(jaxpr) -> int:
    """How many reduce_sums (in any nested jaxpr) read a `mul` directly or through a convert/broadcast/transpose."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    count = 0
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    for eqn in jaxpr.eqns:
        for sub in subjaxprs(eqn):
            count += sums_of_products(sub)
        if eqn.primitive.name != "reduce_sum":
            continue
        src = eqn.invars[0]
        while isinstance(src, Var) and src in producer:
            p = producer[src]
            if p.primitive.name == "mul":
                count += 1
                break
            if p.primitive.name not in ("convert_element_type", "transpose", "broadcast_in_dim", "reshape", "squeeze"):
                break
            src = p.invars[0]
    return count


def oracle(spec: str, *operands) -> np.ndarray:
    """float64 numpy einsum of the operands (bf16 inputs are widened exactly)."""
    return np.einsum(spec, *(np.asarray(x, np.float64) for x in operands))


def oracle_bound(spec: str, *operands) -> np.ndarray:
    """sum of |terms| per output element: the scale a rounding error is measured against."""
    return np.einsum(spec, *(np.abs(np.asarray(x, np.float64)) for x in operands))


def assert_close(actual, expected, bound, rtol: float, what: str = "") -> None:
    actual = np.asarray(actual, np.float64)
    err = np.abs(actual - expected)
    limit = rtol * (bound + 1e-30) + 1e-30
    bad = err > limit
    assert not bad.any(), f"{what}: {bad.sum()} element(s) off; worst |err| {err.max():.3g} vs limit {limit.max():.3g}"


def einsum_grads(spec: str, operands: list, cotangent) -> list[np.ndarray]:
    """d/dX_i of sum(cotangent * einsum(spec, *operands)) by float64 einsums, one per operand."""
    ins, out = spec.split("->")
    labels = ins.split(",")
    ops = [np.asarray(x, np.float64) for x in operands]
    w = np.asarray(cotangent, np.float64)
    grads = []
    for i, mine in enumerate(labels):
        others = [lab for j, lab in enumerate(labels) if j != i]
        available = set(out).union(*others)
        kept = "".join(c for c in mine if c in available)
        g = np.einsum(",".join([out, *others]) + "->" + kept, w, *(ops[j] for j in range(len(ops)) if j != i))
        # labels only this operand carries (and sums away) get a constant gradient along them
        shape = [ops[i].shape[mine.index(c)] if c in kept else 1 for c in mine]
        g = g.reshape(shape)
        grads.append(np.broadcast_to(g, ops[i].shape))
    return grads
