"""Property-based tests: random einsum-like expressions written as broadcast-multiply-sum, checked against float64
numpy einsum (values and gradients) and structurally (every eligible site becomes a contraction)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax import lax
from test_rewriter_helpers import assert_close, einsum_grads, oracle, oracle_bound, primitives, sums_of_products

import rewriter

LABELS = "abcdef"
WRAPPERS = ("none", "jit", "scan", "remat", "cond")
RTOL = {"float32": 1e-5, "bfloat16": 2e-2}
GATE_OFF = dict(min_flops=0, min_dim=1)


@dataclasses.dataclass(frozen=True)
class Expr:
    ops: tuple[str, ...]  # labels of each operand, in its own dim order
    out: str
    frame: str  # dim order of the broadcast product
    sizes: dict[str, int]
    views: tuple[str, ...]  # how each operand is lifted to the frame: "reshape" / "index" / "unit"
    literal: bool  # an extra Python-scalar factor
    dtype: str
    wrapper: str
    seed: int

    @property
    def spec(self) -> str:
        return ",".join(self.ops) + "->" + self.out

    @property
    def reduced(self) -> str:
        return "".join(c for c in self.frame if c not in self.out)

    def shape(self, labels: str) -> tuple[int, ...]:
        return tuple(self.sizes[c] for c in labels)


@st.composite
def expressions(draw) -> Expr:
    """Random label sets per operand. Three times in four the expression is made GEMM-like: operands 0 and 1 each
    own a kept label ("a", "b") and share a summed one ("c"), so the site is eligible whatever else is drawn."""
    n_labels = draw(st.integers(3, 6))
    labels = LABELS[:n_labels]
    size = st.one_of(st.integers(2, 5), st.integers(2, 5), st.just(1))  # unit dims a third of the time
    sizes = {c: draw(size) for c in labels}
    n_ops = draw(st.integers(2, 4))
    ops = []
    for i in range(n_ops):
        least = 0 if i == n_ops - 1 else 1  # the last operand may be a scalar
        ops.append(set(draw(st.lists(st.sampled_from(labels), unique=True, min_size=least, max_size=n_labels))))
    gemm_like = draw(st.sampled_from([True, True, True, False]))
    if gemm_like:
        sizes |= {c: draw(st.integers(2, 5)) for c in "abc"}
        ops = [(ops[0] | {"a", "c"}) - {"b"}, (ops[1] | {"b", "c"}) - {"a"}, *(o - {"a", "b"} for o in ops[2:])]
    ops = ["".join(draw(st.permutations(sorted(o)))) for o in ops]
    union = sorted(set("".join(ops)))
    must = {"a", "b"} if gemm_like else set()
    optional = [c for c in union if c not in must and not (gemm_like and c == "c")]
    extra = st.lists(st.sampled_from(optional), unique=True, max_size=len(optional) - 1) if optional else st.just([])
    kept = sorted(must) + draw(extra)
    return Expr(
        ops=tuple(ops),
        out="".join(draw(st.permutations(kept))),
        frame="".join(draw(st.permutations(union))),
        sizes=sizes,
        views=tuple(draw(st.sampled_from(["reshape", "index", "unit"])) for _ in ops),
        literal=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        wrapper=draw(st.sampled_from(WRAPPERS)),
        seed=draw(st.integers(0, 2**16)),
    )


def lift(e: Expr, x, labels: str, view: str):
    """Transpose an operand into frame order and give it the frame's rank with unit dims."""
    order = sorted(labels, key=e.frame.index)
    x = jnp.transpose(x, [labels.index(c) for c in order])
    if view == "unit":  # a unit dim added by reshape, then squeezed away
        x = lax.squeeze(x.reshape(*x.shape, 1), (x.ndim,))
    if view == "index":
        return x[tuple(slice(None) if c in labels else None for c in e.frame)]
    return x.reshape([e.sizes[c] if c in labels else 1 for c in e.frame])


def build(e: Expr):
    """The expression as broadcast products and a sum, wrapped in the drawn higher-order primitive."""

    def product_sum(*xs):
        prod = lift(e, xs[0], e.ops[0], e.views[0])
        for x, labels, view in zip(xs[1:], e.ops[1:], e.views[1:]):
            prod = prod * lift(e, x, labels, view)
        if e.literal:
            prod = prod * 0.5
        total = prod.sum(axis=tuple(e.frame.index(c) for c in e.reduced))
        kept = [c for c in e.frame if c in e.out]
        return jnp.transpose(total, [kept.index(c) for c in e.out])

    if e.wrapper == "jit":
        return jax.jit(product_sum)
    if e.wrapper == "remat":
        return jax.checkpoint(product_sum)
    if e.wrapper == "cond":
        return lambda *xs: lax.cond(xs[0].sum() > -1e30, product_sum, lambda *a: product_sum(*a) * 2, *xs)
    if e.wrapper == "scan":
        return lambda x0, *rest: lax.scan(lambda c, x: (c, product_sum(x, *rest)), 0.0, x0)[1]
    return product_sum


def inputs(e: Expr) -> list:
    rng = np.random.default_rng(e.seed)
    shapes = [e.shape(labels) for labels in e.ops]
    if e.wrapper == "scan":
        shapes[0] = (2, *shapes[0])
    return [jnp.asarray(rng.standard_normal(s), jnp.float32).astype(e.dtype) for s in shapes]


def oracle_spec(e: Expr) -> str:
    if e.wrapper != "scan":
        return e.spec
    return ",".join(["z" + e.ops[0], *e.ops[1:]]) + "->z" + e.out


def expected_status(e: Expr) -> str | None:
    """What the gate (with min_flops=0, min_dim=1) must do, from the expression alone; None: either is allowed."""
    big = {c for c, n in e.sizes.items() if n > 1}
    tensors = [set(labels) & big for labels in e.ops if set(labels) & big]
    if not set(e.reduced) & big or len(tensors) < 2:
        return "skipped"
    keep = set(e.out) & big
    free = [ops & keep - set().union(*(o for o in tensors if o is not ops)) for ops in tensors]
    if len(tensors) == 2:
        return "skipped" if not any(free) else "rewritten"
    shared = any(sum(c in ops for ops in tensors) >= 2 for c in set(e.reduced) & big)
    return "rewritten" if shared and sum(bool(f) for f in free) >= 2 else None


def contracted(e: Expr) -> bool:
    big = {c for c, n in e.sizes.items() if n > 1}
    return any(sum(c in labels for labels in e.ops) >= 2 for c in set(e.reduced) & big)


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(expressions())
def test_random_broadcast_sums(e: Expr):
    fn = build(e)
    fast = rewriter.rewrite(fn, **GATE_OFF)
    xs = inputs(e)
    spec = oracle_spec(e)
    factor = 0.5 if e.literal else 1.0

    out = fast(*xs)
    assert out.dtype == jnp.dtype(e.dtype)
    assert_close(out, factor * oracle(spec, *xs), factor * oracle_bound(spec, *xs), RTOL[e.dtype], "value")

    cotangent = np.random.default_rng(e.seed + 1).standard_normal(out.shape).astype(np.float32)
    loss = lambda *a: jnp.sum(fast(*a).astype(jnp.float32) * cotangent)
    grads = jax.grad(loss, argnums=tuple(range(len(xs))))(*xs)
    abs_xs = [np.abs(np.asarray(x, np.float64)) for x in xs]
    for i, (g, want, bound) in enumerate(
        zip(grads, einsum_grads(spec, xs, cotangent), einsum_grads(spec, abs_xs, np.abs(cotangent)))
    ):
        assert_close(g, factor * want, factor * bound, 2 * RTOL[e.dtype], f"grad {i}")

    report = fast.last_report
    event(f"{e.wrapper} {e.dtype} {len(e.ops)} operands: {report.sites[0].status if report.sites else 'no site'}")
    assert len(report.sites) == (2 if e.wrapper == "cond" else 1), str(report)
    expected = expected_status(e)
    for site in report.sites:
        if expected is not None:
            assert site.status == expected, f"{e}\n{report}"
        elif site.status != "rewritten":
            assert site.reason.startswith("vector-by-vector"), f"{e}\n{report}"
    if all(site.status == "rewritten" for site in report.sites):
        jaxpr = jax.make_jaxpr(fast)(*xs)
        assert sums_of_products(jaxpr) == 0, f"a broadcast product is still summed:\n{jaxpr}"
        assert ("dot_general" in primitives(jaxpr)) == contracted(e), str(jaxpr)
