"""The training step: token-weighted cross-entropy, its gradient over micro-batches, and AdamW.

Pure functions of (params, opt_state, batch), jitted once: the model is split into its graph and parameters
(`nnx.split`) and merged inside, so checkpoints and the optimizer see plain pytrees of arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from granite_jax.model import widened

Array = jax.Array


def schedule(peak: float, warmup_steps: int, total_steps: int, final_ratio: float) -> optax.Schedule:
    """Linear warm-up from 0 to `peak` over `warmup_steps`, then cosine decay to `peak * final_ratio` at
    `total_steps`."""
    warmup = min(warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), peak * final_ratio)


def optimizer(lr: optax.Schedule, *, weight_decay: float, b1: float, b2: float, clip_norm: float):
    """Gradient clipping by global norm, then AdamW; weight decay on matrices only (norms, biases and the Mamba
    mixer's per-head vectors are not decayed, as is usual for AdamW on transformers)."""
    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=matrices),
    )


def token_loss(graphdef: nnx.GraphDef, params: Any, inputs: Array, targets: Array, mask: Array) -> tuple[Array, Array]:
    """(sum of the masked tokens' cross-entropy in nats, their count) for rows (b, T): logits in float32 (float64 in
    a float64 model)."""
    logits = nnx.merge(graphdef, params)(inputs)
    nll = optax.softmax_cross_entropy_with_integer_labels(widened(logits), targets)
    return (nll * mask).sum(), mask.sum()


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """step(params, opt_state, inputs, targets, mask) with batch arrays (accumulate, micro, T): the gradient of the
    mean token loss of the whole batch (micro-batch gradients summed in float32 by a scan, then divided by the
    batch's token count), one optimizer update. Returns (params, opt_state, metrics)."""

    def micro_step(params, carry, rows):
        grads, loss, count = carry
        (s, n), g = jax.value_and_grad(lambda p: token_loss(graphdef, p, *rows), has_aux=True)(params)
        grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
        return (grads, loss + s, count + n), None

    def step(params, opt_state, inputs, targets, mask):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
        init = (zeros, jnp.float32(0), jnp.float32(0))
        (grads, loss, count), _ = lax.scan(lambda c, r: micro_step(params, c, r), init, (inputs, targets, mask))
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, params)
        metrics = dict(loss=loss / count, tokens=count, grad_norm=_norm(grads))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(graphdef: nnx.GraphDef):
    """eval(params, inputs, targets, mask) -> (summed token loss, token count) of rows (b, T)."""
    return jax.jit(lambda params, *rows: token_loss(graphdef, params, *rows))


def _norm(tree) -> Array:
    """The global L2 norm of a pytree (the norm clipping reads; optax renames its helper across versions)."""
    return jnp.sqrt(sum(jnp.vdot(x, x).real for x in jax.tree.leaves(tree)))
