"""Matching broadcast-multiply-sum sites in one jaxpr and labelling their dims, einsum style.

A site is rooted at a `reduce_sum`. Walking back from its operand, each dim of size > 1 gets a label; the walk goes
through view ops (broadcast_in_dim, transpose, squeeze, unit-dim reshapes, sums over size-1 dims, widening
converts, copies) and through `mul`s, `neg`s and divisions by a scalar whose result has no other consumer (nor has
any value between it and the root). Every value where the walk stops is an operand: its dims carry the labels of
the product dims they feed, and a size-1 dim that was broadcast carries none. The walk stops at `checkpoint_name`:
a named value is kept for remat policies.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
import opt_einsum
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var

Label = int
Dims = tuple[Label | None, ...]


@dataclasses.dataclass(frozen=True)
class Operand:
    """A value entering a contraction: one label per dim of `atom` (None: size 1, or a broadcast to drop)."""

    atom: Var | Literal
    dims: Dims
    exclusive: bool = True  # reached from the product only through values with no other consumer
    divisor: bool = False  # a scalar the product is divided by (only among `Contraction.scalars`)

    @property
    def labels(self) -> tuple[Label, ...]:
        return tuple(d for d in self.dims if d is not None)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.atom.aval.dtype)


@dataclasses.dataclass(frozen=True)
class Contraction:
    """sign times the sum over `reduced` of the product of `operands` and `scalars` (divided by the divisor ones),
    laid out as `out` (one label per output dim)."""

    operands: tuple[Operand, ...]
    scalars: tuple[Operand, ...]
    sizes: dict[Label, int]
    out: Dims
    reduced: frozenset[Label]
    sign: int = 1

    @property
    def present(self) -> Counter:
        return Counter(label for op in self.operands for label in op.labels)

    @property
    def kept(self) -> tuple[Label, ...]:
        """Output labels computed by the einsum (the others are broadcast afterwards)."""
        present = self.present
        return tuple(label for label in self.out if label is not None and present[label])

    @property
    def scale(self) -> int:
        """Reduced labels that no operand carries: the sum over them multiplies by their size."""
        present = self.present
        return math.prod(self.sizes[label] for label in self.reduced if not present[label])

    def spec(self) -> str:
        letters = _letters(self.sizes)
        ins = ",".join("".join(letters[label] for label in op.labels) for op in self.operands)
        return f"{ins}->{''.join(letters[label] for label in self.kept)}"

    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(self.sizes[label] for label in op.labels) for op in self.operands]


def _letters(sizes: dict[Label, int]) -> dict[Label, str]:
    """a-z, A-Z, then the unicode symbols opt_einsum uses beyond 52 labels."""
    return {label: opt_einsum.get_symbol(i) for i, label in enumerate(sorted(sizes))}


@dataclasses.dataclass
class Match:
    """A reduce_sum over a product of operands, before the gate and chain fusion."""

    eqn_index: int
    contraction: Contraction | None  # None when the product has other consumers
    products: list[Var]  # the mul results the site removes
    problem: str | None = None
    absorbed: tuple[int, ...] = ()  # roots of sums over size-1 dims the walk went through

    @property
    def product(self) -> Var:
        return self.products[0]


# ------------------------------------------------------------------------------------------------- view ops


def _broadcast_in_dim(eqn: JaxprEqn, dims: Dims) -> Dims:
    src = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    bdims = eqn.params["broadcast_dimensions"]
    return tuple(dims[b] if src[i] == out[b] else None for i, b in enumerate(bdims))


def _transpose(eqn: JaxprEqn, dims: Dims) -> Dims:
    src: list[Label | None] = [None] * len(dims)
    for j, p in enumerate(eqn.params["permutation"]):
        src[p] = dims[j]
    return tuple(src)


def _drop_units(eqn: JaxprEqn, dims: Dims, removed: Iterable[int]) -> Dims:
    """Input dims of an op that only removes the size-1 input dims `removed`."""
    removed = set(removed)
    rest = iter(dims)
    return tuple(None if i in removed else next(rest) for i in range(eqn.invars[0].aval.ndim))


def _reshape(eqn: JaxprEqn, dims: Dims) -> Dims | None:
    """A reshape that only adds or removes size-1 dims keeps the order of the others: relabel them."""
    if eqn.params.get("dimensions") is not None:
        return None
    src, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if [s for s in src if s != 1] != [s for s in out if s != 1]:
        return None
    real = iter(d for d, s in zip(dims, out) if s != 1)
    return tuple(None if s == 1 else next(real) for s in src)


def _is_widening(src: np.dtype, dst: np.dtype) -> bool:
    """Every value of float dtype `src` is exactly representable in float dtype `dst`."""
    if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
        return False
    a, b = jnp.finfo(src), jnp.finfo(dst)
    return b.nmant >= a.nmant and b.maxexp >= a.maxexp and b.minexp <= a.minexp


def view_source_dims(eqn: JaxprEqn, dims: Dims) -> Dims | None:
    """Labels of `eqn.invars[0]`'s dims when `eqn` is a pure view of it (no arithmetic); None otherwise."""
    name = eqn.primitive.name
    if len(eqn.outvars) != 1 or not eqn.invars or isinstance(eqn.invars[0], Literal):
        return None
    if name == "broadcast_in_dim" and len(eqn.invars) == 1:
        return _broadcast_in_dim(eqn, dims)
    if name == "transpose":
        return _transpose(eqn, dims)
    if name == "squeeze":
        return _drop_units(eqn, dims, eqn.params["dimensions"])
    if name == "reshape" and len(eqn.invars) == 1:
        return _reshape(eqn, dims)
    if name == "reduce_sum" and all(eqn.invars[0].aval.shape[a] == 1 for a in eqn.params["axes"]):
        return _drop_units(eqn, dims, eqn.params["axes"])
    if name == "convert_element_type" and _is_widening(eqn.invars[0].aval.dtype, eqn.params["new_dtype"]):
        return dims
    if name == "copy":
        return dims
    return None


# ------------------------------------------------------------------------------------------------- matching


class Matcher:
    """Finds the product feeding each reduce_sum of one jaxpr."""

    def __init__(self, jaxpr: Jaxpr):
        self.jaxpr = jaxpr
        self.producer: dict[Var, int] = {}
        self.uses: Counter = Counter()
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                self.producer[v] = i
            self.uses.update(v for v in eqn.invars if isinstance(v, Var))
        self.uses.update(v for v in jaxpr.outvars if isinstance(v, Var))

    def eqn_of(self, atom) -> JaxprEqn | None:
        if isinstance(atom, Literal) or atom not in self.producer:
            return None
        return self.jaxpr.eqns[self.producer[atom]]

    def is_root(self, eqn: JaxprEqn) -> bool:
        """A reduce_sum of a variable: a candidate site (`match` decides whether a product feeds it)."""
        return eqn.primitive.name == "reduce_sum" and not isinstance(eqn.invars[0], Literal)

    def match(self, index: int) -> Match | None:
        """The site rooted at reduce_sum equation `index`, or None when no `mul` feeds it."""
        eqn = self.jaxpr.eqns[index]
        src = eqn.invars[0]
        sizes: dict[Label, int] = {}
        dims = []
        for size in src.aval.shape:
            if size == 1:
                dims.append(None)
            else:
                dims.append(len(sizes))
                sizes[len(sizes)] = size
        axes = set(eqn.params["axes"])
        out = tuple(d for a, d in enumerate(dims) if a not in axes)
        reduced = frozenset(d for a, d in enumerate(dims) if a in axes and d is not None)
        walk = _Walk(self)
        top = walk.top(src, tuple(dims))
        if top is None:
            return None
        if top == "shared":
            return Match(index, None, walk.products, "the product has other consumers")
        operands = tuple(op for op in walk.leaves if op.labels)
        scalars = tuple(op for op in walk.leaves if not op.labels)
        contraction = Contraction(operands, scalars, sizes, out, reduced, walk.sign)
        return Match(index, contraction, walk.products, absorbed=tuple(walk.absorbed))


class _Walk:
    """One walk from a site root down to its operands."""

    def __init__(self, matcher: Matcher):
        self.m = matcher
        self.leaves: list[Operand] = []
        self.products: list[Var] = []
        self.absorbed: list[int] = []
        self.sign = 1

    def top(self, atom, dims: Dims) -> str | None:
        """Walk the views between the root and the first mul; 'shared' if the product escapes, None if no mul."""
        shared = False
        while True:
            eqn = self.m.eqn_of(atom)
            if eqn is None:
                return None
            shared = shared or self.m.uses[atom] > 1
            if eqn.primitive.name == "mul":
                if shared:
                    self.products.append(atom)
                    return "shared"
                self.tree(atom, dims, exclusive=True)
                return "ok"
            if not shared and (below := self.scale(eqn, dims)) is not None:
                atom = below
                continue
            src = self.view(atom, eqn, dims, not shared)
            if src is None:
                return None
            atom, dims = eqn.invars[0], src

    def view(self, atom, eqn: JaxprEqn, dims: Dims, exclusive: bool = True) -> Dims | None:
        """The labels of a view's source. A size-1 sum on the exclusive path is absorbed: its work vanishes."""
        src = view_source_dims(eqn, dims)
        if src is not None and eqn.primitive.name == "reduce_sum" and exclusive:
            self.absorbed.append(self.m.producer[atom])
        return src

    def tree(self, atom, dims: Dims, exclusive: bool) -> None:
        """Walk down from `atom` (labelled `dims`). `exclusive`: every value above it, up to the root, has one use;
        only then is a product below it computed inside the contraction (else it is an operand, computed anyway)."""
        eqn = self.m.eqn_of(atom)
        owned = exclusive and isinstance(atom, Var) and self.m.uses[atom] == 1
        if eqn is None:  # an input or a literal
            self.leaves.append(Operand(atom, dims, owned))
            return
        if owned and eqn.primitive.name == "mul":
            self.products.append(atom)
            for x in eqn.invars:
                self.tree(x, dims if x.aval.ndim == len(dims) else (None,) * x.aval.ndim, True)
            return
        if owned and (below := self.scale(eqn, dims)) is not None:
            self.tree(below, dims, True)
            return
        src = self.view(atom, eqn, dims, owned)
        if src is not None:
            self.tree(eqn.invars[0], src, owned)
            return
        self.leaves.append(Operand(atom, dims, owned))

    def scale(self, eqn: JaxprEqn, dims: Dims):
        """The value under a negation or a division by a scalar (its sign or divisor recorded), else None."""
        if eqn.primitive.name == "neg":
            self.sign = -self.sign
            return eqn.invars[0]
        if eqn.primitive.name == "div" and (divisor := self.scalar(eqn.invars[1], dims)) is not None:
            self.leaves.append(divisor)
            return eqn.invars[0]
        return None

    def scalar(self, atom, dims: Dims) -> Operand | None:
        """`atom` as a divisor when it is one value broadcast (through views only) over the product's dims."""
        dims = dims if atom.aval.ndim == len(dims) else (None,) * atom.aval.ndim
        while True:
            if any(d is not None and atom.aval.shape[a] != 1 for a, d in enumerate(dims)):
                eqn = self.m.eqn_of(atom)
                src = view_source_dims(eqn, dims) if eqn is not None else None
                if src is None:
                    return None
                atom, dims = eqn.invars[0], src
                continue
            return Operand(atom, (None,) * atom.aval.ndim, False, divisor=True)
