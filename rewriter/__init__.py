"""Jaxpr rewriter: finds contractions written as a broadcast product followed by a sum, in any JAX function,
and emits `lax.dot_general` contractions instead.

    fast = rewriter.rewrite(fn)                  # composes with jax.jit, jax.grad, jax.vmap
    print(rewriter.analyze(fn, *abstract_args))  # per-site report; accepts jax.ShapeDtypeStruct

See docs/rewriter.md.
"""

from rewriter.api import Rewritten, VerificationError, analyze, rewrite
from rewriter.options import Options
from rewriter.site import Report, Site

__all__ = ["Options", "Report", "Rewritten", "Site", "VerificationError", "analyze", "rewrite"]
