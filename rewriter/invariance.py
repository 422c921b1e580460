"""Hidden broadcasts: for each value of a jaxpr, the axes along which it is provably constant.

A value built as `broadcast_in_dim` and then reshaped, padded, chunked or passed through elementwise ops is still
constant along the broadcast axis, although no view op shows it at the contraction. Slicing such an operand at
index 0 along that axis and dropping its label gives the same einsum with fewer FLOPs (e.g. per-group instead of
per-head scores when heads share one group). The analysis is a forward pass with one conservative rule per
primitive; unknown primitives keep only their size-1 axes.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

Axes = frozenset[int]

ELEMENTWISE = frozenset(
    """add sub mul div rem pow max min atan2 nextafter and or xor not neg sign floor ceil round is_finite exp exp2
    log log1p expm1 tanh logistic sin cos tan asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs
    integer_pow square erf erfc erf_inv lgamma digamma convert_element_type select_n clamp eq ne lt le gt ge copy
    copy_p reduce_precision real imag conj shift_left shift_right_logical shift_right_arithmetic population_count
    """.split()
)
CALL_LIKE = frozenset("jit pjit closed_call core_call remat2 checkpoint custom_jvp_call custom_vjp_call".split())
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())


def _units(atom) -> Axes:
    return frozenset(i for i, n in enumerate(atom.aval.shape) if n == 1)


def sub_jaxpr(eqn: JaxprEqn) -> Jaxpr | None:
    """The body of a call-like equation, whose invars are the equation's operands."""
    for key in ("jaxpr", "call_jaxpr"):
        value = eqn.params.get(key)
        if isinstance(value, ClosedJaxpr):
            value = value.jaxpr
        if isinstance(value, Jaxpr) and len(value.invars) == len(eqn.invars):
            return value
    return None


class Invariance:
    """Invariant axes of every value of a jaxpr (memoised across its call-like sub-jaxprs)."""

    def __init__(self, jaxpr: Jaxpr, in_axes: Sequence[Axes] | None = None, _cache: dict | None = None):
        self._cache = {} if _cache is None else _cache
        self.env: dict[Var, Axes] = {}
        for v, axes in zip(jaxpr.invars, in_axes or ()):
            self.env[v] = frozenset(axes) | _units(v)
        for eqn in jaxpr.eqns:
            outs = self._rule(eqn, [self[x] for x in eqn.invars])
            for v, axes in zip(eqn.outvars, outs):
                self.env[v] = frozenset(axes) | _units(v)

    def __getitem__(self, atom) -> Axes:
        if isinstance(atom, Literal):
            return frozenset(range(len(atom.aval.shape))) if not atom.aval.shape else _units(atom)
        return self.env.get(atom, _units(atom))

    def _call(self, jaxpr: Jaxpr, in_axes: list[Axes]) -> list[Axes]:
        key = (id(jaxpr), tuple(in_axes))
        if key not in self._cache:
            sub = Invariance(jaxpr, in_axes, self._cache)
            self._cache[key] = (jaxpr, [sub[v] for v in jaxpr.outvars])  # keep jaxpr alive: ids stay unique
        return self._cache[key][1]

    def _rule(self, eqn: JaxprEqn, ins: list[Axes]) -> list[Axes]:
        name, p = eqn.primitive.name, eqn.params
        if not eqn.outvars:  # e.g. debug_callback
            return []
        out = eqn.outvars[0].aval
        none = [frozenset()] * len(eqn.outvars)
        if name in ELEMENTWISE:
            full = [a for a, x in zip(ins, eqn.invars) if x.aval.ndim == out.ndim]
            if any(x.aval.ndim not in (0, out.ndim) for x in eqn.invars):
                return none
            return [frozenset.intersection(*full) if full else frozenset(range(out.ndim))]
        if name in CALL_LIKE and (body := sub_jaxpr(eqn)) is not None:
            return self._call(body, ins)
        if name == "cond":
            branch_outs = [self._call(b.jaxpr, ins[1:]) for b in p["branches"]]
            return [frozenset.intersection(*axes) for axes in zip(*branch_outs)]
        if name == "broadcast_in_dim" and len(eqn.invars) == 1:
            src = eqn.invars[0].aval.shape
            kept = {b for i, b in enumerate(p["broadcast_dimensions"]) if i not in ins[0] and src[i] != 1}
            return [frozenset(range(out.ndim)) - kept]
        if name == "transpose":
            return [frozenset(j for j, i in enumerate(p["permutation"]) if i in ins[0])]
        if name == "squeeze":
            rest = [i for i in range(eqn.invars[0].aval.ndim) if i not in p["dimensions"]]
            return [frozenset(j for j, i in enumerate(rest) if i in ins[0])]
        if name == "reshape" and p.get("dimensions") is None and len(eqn.invars) == 1:
            return [_reshape(eqn.invars[0].aval.shape, out.shape, ins[0])]
        if name in REDUCTIONS:
            rest = [i for i in range(eqn.invars[0].aval.ndim) if i not in p["axes"]]
            return [frozenset(j for j, i in enumerate(rest) if i in ins[0])] * len(eqn.outvars)
        if name in CUMULATIVE:
            return [ins[0] - {p["axis"]}]
        if name in ("slice", "dynamic_slice", "rev"):
            return [ins[0]]
        if name == "pad":
            return [frozenset(a for a in ins[0] if tuple(p["padding_config"][a]) == (0, 0, 0))]
        if name == "concatenate":
            return [frozenset.intersection(*ins) - {p["dimension"]}]
        if name == "split":
            return [ins[0] - {p["axis"]}] * len(eqn.outvars)
        if name == "iota":
            return [frozenset(range(out.ndim)) - {p["dimension"]}]
        if name == "dot_general":
            return [_dot_general(eqn, ins)]
        return none


def _reshape(src: tuple[int, ...], out: tuple[int, ...], inv: Axes) -> Axes:
    """Group input and output dims into blocks of equal size; a block is invariant if all its input dims are."""
    s = [i for i, n in enumerate(src) if n != 1]
    o = [j for j, n in enumerate(out) if n != 1]
    result: set[int] = set()
    i = j = 0
    try:
        while i < len(s) and j < len(o):
            gi, gj = [s[i]], [o[j]]
            ps, po = src[s[i]], out[o[j]]
            i, j = i + 1, j + 1
            while ps != po:
                if ps < po:
                    gi.append(s[i])
                    ps, i = ps * src[s[i]], i + 1
                else:
                    gj.append(o[j])
                    po, j = po * out[o[j]], j + 1
            if all(a in inv for a in gi):
                result.update(gj)
    except IndexError:
        return frozenset()
    return frozenset(result)


def _dot_general(eqn: JaxprEqn, ins: list[Axes]) -> Axes:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.ndim, eqn.invars[1].aval.ndim
    lfree = [i for i in range(lhs) if i not in lc and i not in lb]
    rfree = [i for i in range(rhs) if i not in rc and i not in rb]
    flags = [a in ins[0] and b in ins[1] for a, b in zip(lb, rb)]
    flags += [i in ins[0] for i in lfree] + [i in ins[1] for i in rfree]
    return frozenset(k for k, flag in enumerate(flags) if flag)
