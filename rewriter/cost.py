"""Cost model: the pairwise contraction order (opt_einsum), FLOPs per step, and the profitability gate."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import opt_einsum

from rewriter.options import Options
from rewriter.pattern import Contraction


@dataclasses.dataclass(frozen=True)
class Step:
    """One pairwise dot_general of the path: batch, free (M, N) and contracted (K) sizes, and its FLOPs."""

    batch: int
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return (2 if self.k > 1 else 1) * self.batch * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True)
class Plan:
    path: tuple[tuple[int, ...], ...]
    steps: tuple[Step, ...]
    flops: int  # contraction FLOPs plus the single-operand pre-sums

    @property
    def main(self) -> Step | None:
        return max(self.steps, key=lambda s: s.flops, default=None)


def contraction_plan(c: Contraction) -> Plan:
    """The cheapest pairwise order of `c` and what each step costs."""
    operands = [frozenset(op.labels) for op in c.operands]
    if not operands:
        return Plan((), (), 0)
    if len(operands) > 1:
        strategy = "optimal" if len(operands) <= 5 else "greedy"
        path, _ = opt_einsum.contract_path(c.spec(), *c.shapes(), shapes=True, optimize=strategy)
    else:
        path = [(0,)]
    size = lambda labels: math.prod(c.sizes[label] for label in labels)
    final = frozenset(c.kept)
    steps, flops = [], 0
    for pair in path:
        pair = tuple(sorted(pair, reverse=True))
        taken = [operands.pop(i) for i in pair]
        rest = final.union(*operands)
        if len(taken) == 1:
            flops += size(taken[0])
            operands.append(taken[0] & rest)
            continue
        lhs, rhs = taken
        # labels only one side carries and nobody needs are summed on that side before the dot
        flops += sum(size(side) for side in (lhs, rhs) if side - rest - (lhs & rhs))
        lhs, rhs = lhs & (rest | rhs), rhs & (rest | lhs)
        batch, contract = lhs & rhs & rest, (lhs & rhs) - rest
        step = Step(size(batch), size(lhs - rhs), size(rhs - lhs), size(contract))
        steps.append(step)
        flops += step.flops
        operands.append((lhs | rhs) & rest)
    return Plan(tuple(tuple(p) for p in path), tuple(steps), flops)


def skip_reason(c: Contraction, plan: Plan, options: Options) -> str | None:
    """Why rewriting `c` would not pay off, or None if it should be rewritten."""
    dtypes = [op.dtype for op in (*c.operands, *c.scalars)]
    if not all(jnp.issubdtype(d, jnp.floating) for d in dtypes):
        return f"non-float operands ({', '.join(sorted({str(d) for d in dtypes}))})"
    if 0 in c.sizes.values():
        return "a zero-size dim: the product is empty"
    if not any(c.sizes[label] > 1 for label in c.reduced):
        return "sum over size-1 dims only: a plain multiply"
    if len(c.operands) < 2:
        return "one tensor operand: a scaled sum, not a contraction"
    main = plan.main
    if main.m == 1 and main.n == 1:
        return "vector-by-vector product: no free dims on either side"
    min_dim = options.gate_min_dim()
    if main.k < min_dim or min(main.m, main.n) < min_dim:
        return f"tiny contraction: K={main.k}, M={main.m}, N={main.n} (min_dim={min_dim})"
    if plan.flops < options.min_flops:
        return f"below the FLOP threshold: {plan.flops:,} < min_flops={options.min_flops:,.0f}"
    return None
