"""Text generation: a `Generator` that loads a model once and generates for one prompt or a batch, many times.

- `generator`: the `Generator`, its `Result` and `Timing`;
- `steps`: the compiled prefill and decode steps;
- `layout`: where a batch sits in the cache, and the shape buckets that bound compilation;
- `prompts`: text and token ids in; `stream`: text out, stop strings, streaming.

The command line is `python -m granite_jax.generate`.
"""

from granite_jax.errors import GenerationError
from granite_jax.generation.generator import Generator, Result, Timing, generate
from granite_jax.sampling import SamplingConfig

__all__ = ["GenerationError", "Generator", "Result", "SamplingConfig", "Timing", "generate"]
