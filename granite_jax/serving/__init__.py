"""Serving: continuous batching over a Generator's model, and the OpenAI-compatible HTTP API around it.

- `engine`: the `Engine`, its `Request` and `Outcome`: decode slots that requests join and leave token by token;
- `rows`: the decode batch's cache, one sequence a row on one clock;
- `prefix`: prefix caching of the hybrid's state (token-exact snapshots, LRU);
- `api`: the FastAPI application (`create_app`).

The command line is `python -m granite_jax.serve`.
"""

from granite_jax.serving.engine import Engine, Outcome, Overloaded, Request

__all__ = ["Engine", "Outcome", "Overloaded", "Request"]
