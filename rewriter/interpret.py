"""Re-tracing evaluator: runs a jaxpr equation by equation inside the caller's trace, emitting a contraction at
each rewritten site and re-tracing the bodies of higher-order primitives that contain rewritten sites.

Only equations whose results are needed are evaluated, so in eager mode the broadcast product is never built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from rewriter import emit
from rewriter.plan import JaxprPlan, SitePlan


@dataclasses.dataclass(frozen=True)
class Context:
    precision: Any
    enabled: Callable[[int], bool] = lambda site_id: True


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], plan: JaxprPlan, ctx: Context) -> list:
    env: dict[Var, Any] = {}
    read = lambda atom: atom.val if isinstance(atom, Literal) else env[atom]
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    active = {i: p for i, p in plan.rewrites.items() if ctx.enabled(p.site.id)}
    for i in live_equations(jaxpr, active):
        eqn = jaxpr.eqns[i]
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            if i in active:
                site = active[i]
                outs = [emit.contract(site.contraction, site.cost, read, eqn.outvars[0].aval, ctx.precision)]
            else:
                outs = bind(eqn, [read(x) for x in eqn.invars], plan.children.get(i), ctx)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def live_equations(jaxpr: Jaxpr, active: dict[int, SitePlan]) -> list[int]:
    """Indices of the equations the outputs need once the active sites read their operands directly."""
    needed = {v for v in jaxpr.outvars if isinstance(v, Var)}
    live = []
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if not (eqn.effects or any(v in needed for v in eqn.outvars)):
            continue
        live.append(i)
        if i in active:
            c = active[i].contraction
            inputs = [op.atom for op in (*c.operands, *c.scalars)]
        else:
            inputs = eqn.invars
        needed.update(v for v in inputs if isinstance(v, Var))
    return live[::-1]


def bind(eqn: JaxprEqn, invals: list, children: dict | None, ctx: Context) -> list:
    params = eqn.params
    if children and any(_has_rewrites(plan, ctx) for plan in children.values()):
        if eqn.primitive.name == "shard_map":
            return _shard_map(eqn, invals, children["jaxpr"], ctx)
        params = dict(params)
        for key, plan in children.items():
            params[key] = _rewrite_param(params[key], plan, ctx)
    bind_params = eqn.primitive.get_bind_params(params)
    subfuns, bind_params = bind_params if isinstance(bind_params, tuple) else ([], bind_params)
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _has_rewrites(plan: JaxprPlan | tuple, ctx: Context) -> bool:
    plans = plan if isinstance(plan, tuple) else (plan,)
    return any(p.has_rewrites(ctx.enabled) for p in plans)


def _rewrite_param(value: Any, plan: JaxprPlan | tuple, ctx: Context) -> Any:
    if isinstance(value, tuple):
        return tuple(_rewrite_param(v, p, ctx) for v, p in zip(value, plan))
    if isinstance(value, ClosedJaxpr):
        return retrace(value.jaxpr, value.consts, plan, ctx)
    closed = retrace(value, (), plan, ctx)
    if closed.consts:  # an open-jaxpr param cannot take constants: keep the original body
        return value
    return closed.jaxpr


def retrace(jaxpr: Jaxpr, consts: Sequence[Any], plan: JaxprPlan, ctx: Context) -> ClosedJaxpr:
    """The jaxpr with its planned sites rewritten, as a new closed jaxpr with the same signature."""
    if not plan.has_rewrites(ctx.enabled):
        return ClosedJaxpr(jaxpr, list(consts))
    avals = [jax.ShapeDtypeStruct.like(v.aval) for v in jaxpr.invars]  # keeps weak type, sharding, varying axes
    return jax.make_jaxpr(lambda *xs: eval_jaxpr(jaxpr, consts, xs, plan, ctx))(*avals)


def _shard_map(eqn: JaxprEqn, invals: list, plan: JaxprPlan, ctx: Context) -> list:
    """Re-enter shard_map through its public API, so the body is traced with its mesh axes bound."""
    p = eqn.params
    body = lambda *xs: tuple(eval_jaxpr(p["jaxpr"], (), xs, plan, ctx))
    mapped = jax.shard_map(
        body,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=p["newly_manual_axes"],
        check_vma=p["check_vma"],
    )
    return list(mapped(*invals))
