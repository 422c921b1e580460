"""Planning: every site of a jaxpr and of the jaxprs nested in its higher-order primitives, gated and fused.

The plan is pure analysis over the original jaxprs (nothing is evaluated): `analyze` reports it, `rewrite`
evaluates the jaxpr following it.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from rewriter import cost
from rewriter.invariance import CALL_LIKE, Invariance, sub_jaxpr
from rewriter.options import Options
from rewriter.pattern import Contraction, Match, Matcher
from rewriter.site import FUSED, REWRITTEN, SKIPPED, Site


@dataclasses.dataclass
class SitePlan:
    site: Site
    contraction: Contraction
    cost: cost.Plan
    members: list[SitePlan] = dataclasses.field(default_factory=list)  # sites fused into this one


@dataclasses.dataclass
class JaxprPlan:
    """What to do in one jaxpr: the rewritten roots by equation index, and the plans of nested jaxprs."""

    jaxpr: Jaxpr
    rewrites: dict[int, SitePlan]
    children: dict[int, dict[str, JaxprPlan | tuple[JaxprPlan, ...]]]

    def has_rewrites(self, enabled) -> bool:
        if any(enabled(p.site.id) for p in self.rewrites.values()):
            return True
        return any(
            plan.has_rewrites(enabled)
            for params in self.children.values()
            for value in params.values()
            for plan in (value if isinstance(value, tuple) else (value,))
        )


def nested_jaxprs(eqn: JaxprEqn) -> dict[str, Jaxpr | tuple[Jaxpr, ...]]:
    """Params of `eqn` holding jaxprs (closed or open, alone or in a tuple), as open jaxprs."""
    found = {}
    for key, value in eqn.params.items():
        if isinstance(value, ClosedJaxpr | Jaxpr):
            found[key] = value.jaxpr if isinstance(value, ClosedJaxpr) else value
        elif isinstance(value, tuple) and value and all(isinstance(v, ClosedJaxpr | Jaxpr) for v in value):
            found[key] = tuple(v.jaxpr if isinstance(v, ClosedJaxpr) else v for v in value)
    return found


def _segment(eqn: JaxprEqn, key: str, index: int | None) -> str:
    name = eqn.primitive.name
    label = f"{name}({eqn.params['name']})" if isinstance(eqn.params.get("name"), str) else name
    if key not in ("jaxpr", "call_jaxpr"):
        label += f".{key}"
    return label if index is None else f"{label}[{index}]"


def source_of(eqn: JaxprEqn) -> str:
    text = source_info_util.summarize(eqn.source_info)
    cwd = os.getcwd() + os.sep
    return text.replace(cwd, "") if text.startswith(cwd) else text


class Planner:
    """Plans a jaxpr tree; `sites` collects the report entries in program order."""

    def __init__(self, options: Options):
        self.options = options
        self.sites: list[Site] = []
        self._inv_cache: dict = {}
        self._frozen: str | None = None  # why the jaxpr being planned cannot be rewritten (its sites are reported)

    def plan(self, jaxpr: Jaxpr, path: str = "", in_axes=None) -> JaxprPlan:
        matcher = Matcher(jaxpr)
        inv = Invariance(jaxpr, in_axes, self._inv_cache)
        result = JaxprPlan(jaxpr, {}, {})
        states: dict[int, SitePlan] = {}  # every matched site of this jaxpr, by root equation
        for i, eqn in enumerate(jaxpr.eqns):
            if matcher.is_root(eqn) and (match := matcher.match(i)) is not None:
                self._site(matcher, inv, match, path, states, result)
            if nested := nested_jaxprs(eqn):
                result.children[i] = self._children(eqn, nested, path, inv)
        return result

    def _children(self, eqn: JaxprEqn, nested: dict, path: str, inv: Invariance) -> dict:
        ins = [inv[x] for x in eqn.invars]
        plans = {}
        for key, value in nested.items():
            if isinstance(value, tuple):
                axes = ins[1:] if eqn.primitive.name == "cond" and key == "branches" else None
                plans[key] = tuple(self._child(sub, path, _segment(eqn, key, k), axes) for k, sub in enumerate(value))
            else:
                call_like = eqn.primitive.name in CALL_LIKE and sub_jaxpr(eqn) is value
                plans[key] = self._child(value, path, _segment(eqn, key, None), ins if call_like else None)
        return plans

    def _child(self, jaxpr: Jaxpr, path: str, segment: str, in_axes) -> JaxprPlan:
        path = f"{path}/{segment}" if path else segment
        if self._frozen is not None or over_arrays(jaxpr):
            return self.plan(jaxpr, path, in_axes)
        self._frozen = f"inside {segment.split('.')[0]}, whose body takes refs, not arrays: not rewritten"
        try:
            return self.plan(jaxpr, path, in_axes)
        finally:
            self._frozen = None

    # --------------------------------------------------------------------------------------------- one site

    def _site(self, matcher: Matcher, inv: Invariance, match: Match, path: str, states: dict, result: JaxprPlan):
        eqn = matcher.jaxpr.eqns[match.eqn_index]
        if match.contraction is None:
            self.sites.append(self._entry(eqn, match, None, None, path, 0, reason=match.problem))
            return
        contraction, dropped = drop_hidden_broadcasts(match.contraction, inv)
        plan = cost.contraction_plan(contraction)
        site = self._entry(eqn, match, contraction, plan, path, dropped)
        self.sites.append(site)
        if self._frozen is not None:
            site.reason = self._frozen
            return
        state = SitePlan(site, contraction, plan)
        states[match.eqn_index] = state
        contracts = any(contraction.sizes[label] > 1 for label in contraction.reduced)
        if self.options.fuse_chains and contracts:  # a plain multiply is left for the product it feeds to absorb
            self._fuse(matcher, state, states, result)
        state.site.reason = cost.skip_reason(state.contraction, state.cost, self.options)
        if state.site.reason is None:
            state.site.status = REWRITTEN
            result.rewrites[match.eqn_index] = state
            for index in match.absorbed:  # plain multiplies (sums over size-1 dims) folded into this product
                if index in states and states[index].site.status == SKIPPED:
                    self._absorb_member(state, states[index])

    def _absorb_member(self, state: SitePlan, member: SitePlan) -> None:
        member.site.status, member.site.fused_into = FUSED, state.site.id
        state.members.append(member)

    def _fuse(self, matcher: Matcher, state: SitePlan, states: dict[int, SitePlan], result: JaxprPlan):
        """Compose single-use sites feeding this one while the fused contraction is cheaper and passes the gate."""
        tried = set()
        while True:
            for k, op in enumerate(state.contraction.operands):
                inner = states.get(matcher.producer.get(op.atom, -1)) if op.exclusive else None
                if inner is None or id(inner) in tried or inner.site.status == FUSED:
                    continue
                tried.add(id(inner))
                fused = compose(state.contraction, k, inner.contraction)
                if fused is None:
                    continue
                plan = cost.contraction_plan(fused)
                if plan.flops >= state.cost.flops + inner.cost.flops:
                    continue
                if cost.skip_reason(fused, plan, self.options) is not None:
                    continue
                self._absorb(state, inner, fused, plan, result)
                break
            else:
                return

    def _absorb(self, state: SitePlan, inner: SitePlan, fused: Contraction, plan: cost.Plan, result: JaxprPlan):
        inner.site.reason = None
        for member in (inner, *inner.members):
            self._absorb_member(state, member)
        result.rewrites = {i: p for i, p in result.rewrites.items() if p is not inner}
        state.contraction, state.cost = fused, plan
        site = state.site
        site.spec, site.contraction_path, site.flops = fused.spec(), [tuple(p) for p in plan.path], plan.flops
        site.operand_shapes = fused.shapes()
        site.operand_dtypes = [str(op.dtype) for op in fused.operands]

    def _entry(self, eqn, match: Match, c: Contraction | None, plan, path: str, dropped: int, reason=None) -> Site:
        summed = eqn.invars[0].aval  # the product, or a broadcast of it
        product = max(match.product.aval, summed, key=lambda aval: math.prod(aval.shape))
        elements = math.prod(product.shape)
        naive = sum(math.prod(v.aval.shape) for v in match.products) + math.prod(summed.shape)
        return Site(
            id=len(self.sites) + 1,
            path=path,
            source=source_of(eqn),
            spec=c.spec() if c is not None else "",
            operand_shapes=c.shapes() if c is not None else [],
            operand_dtypes=[str(op.dtype) for op in c.operands] if c is not None else [],
            out_shape=tuple(eqn.outvars[0].aval.shape),
            out_dtype=str(eqn.outvars[0].aval.dtype),
            intermediate_shape=tuple(product.shape),
            intermediate_dtype=str(product.dtype),
            intermediate_elements=elements,
            intermediate_bytes=elements * np.dtype(product.dtype).itemsize,
            flops=plan.flops if plan is not None else 0,
            naive_flops=naive,
            contraction_path=[tuple(p) for p in plan.path] if plan is not None else [],
            hidden_broadcasts=dropped,
            status=SKIPPED,
            reason=reason,
        )


def over_arrays(jaxpr: Jaxpr) -> bool:
    """Whether every input of `jaxpr` is an array (a Pallas kernel body, say, takes refs: it is not retraced)."""
    return all(isinstance(v.aval, jax.core.ShapedArray) for v in (*jaxpr.invars, *jaxpr.constvars))


def drop_hidden_broadcasts(c: Contraction, inv: Invariance) -> tuple[Contraction, int]:
    """Unlabel operand dims along which the operand is constant; operands left without labels become scalars."""
    operands, scalars, dropped = [], list(c.scalars), 0
    for op in c.operands:
        axes = inv[op.atom]
        dims = tuple(None if d is not None and a in axes else d for a, d in enumerate(op.dims))
        dropped += sum(d is not None for d in op.dims) - sum(d is not None for d in dims)
        op = dataclasses.replace(op, dims=dims)
        (operands if op.labels else scalars).append(op)
    return dataclasses.replace(c, operands=tuple(operands), scalars=tuple(scalars)), dropped


def compose(outer: Contraction, k: int, inner: Contraction) -> Contraction | None:
    """Substitute `inner` (a contraction producing operand k of `outer`) into `outer`, renaming its labels."""
    op = outer.operands[k]
    present = inner.present
    mapping, sizes = {}, dict(outer.sizes)
    for inner_label, outer_label in zip(inner.out, op.dims):
        if inner_label is None:
            continue
        if outer_label is None:
            if present[inner_label]:
                return None  # the outer site drops a dim the inner operands carry
            continue
        mapping[inner_label] = outer_label
    reduced = set(outer.reduced)
    fresh = max(sizes, default=-1) + 1
    for label in sorted(inner.reduced):
        mapping[label] = fresh
        sizes[fresh] = inner.sizes[label]
        reduced.add(fresh)
        fresh += 1
    relabel = lambda o: dataclasses.replace(o, dims=tuple(None if d is None else mapping[d] for d in o.dims))
    operands = (*outer.operands[:k], *map(relabel, inner.operands), *outer.operands[k + 1 :])
    scalars = (*outer.scalars, *map(relabel, inner.scalars))
    return Contraction(operands, scalars, sizes, outer.out, frozenset(reduced), outer.sign * inner.sign)
