"""The one seam between the model and platform kernels.

The model is plain JAX. A few of its functions are marked `@replaceable`: the product with a weight matrix, the
norms, the router, the experts' products, the embedding lookup, the Mamba mixer between its projections, attention
over a KV cache, greedy sampling, and the SSD and its one-token step. Their bodies are the definition and run
everywhere. A backend registers faster implementations of some of them (`register`); which run is decided when a
function is traced, by the `Runtime` in effect (`using`; `Granite.forward` enters its model's). An implementation is
called with the plain-JAX function first, and falls back to it for the shapes, dtypes and platforms it does not take.

Backends are modules imported on first use (`BACKENDS`): one that is absent or cannot run here costs speed, nothing
else. A backend may keep arrays derived from the weights (the CPU kernels' packed panels): `prepare` asks for them,
the caller passes them into its jitted step beside the weights, and inside `bound` an implementation finds the one
made from the weight it is given (`companion`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax

from granite_jax.errors import InputError

log = logging.getLogger(__name__)
SSD_IMPLS = ("xla", "naive", "pallas")
BACKENDS = {  # name -> module
    "naive": "granite_jax.ssd",
    "pallas": "granite_jax.pallas",
    "cpu": "granite_jax.cpu",
    "gpu": "granite_jax.gpu",
    "mesh": "granite_jax.sharding",
}
PLATFORM_KERNELS = {"cpu": "cpu", "gpu": "gpu"}  # a JAX platform -> the backend `Runtime.kernels` turns on there
# Platform backends written in plain JAX, which XLA's partitioner splits like the model: they run over a mesh too.
# (The CPU kernels are custom calls, which it cannot split: it would gather their operands whole onto each device.)
PARTITIONABLE = ("gpu",)

Prepared = dict[str, dict[str, jax.Array]]  # backend -> {parameter path: array derived from that parameter}


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How a model runs, apart from what it is (`ModelConfig`): changing it changes no weight.

    ssd: the SSD implementation: "xla" (chunked, einsum contractions), "naive" (broadcast products and sums, the
    rewriter's input) or "pallas" (Triton kernels, NVIDIA GPUs only: the SSD, and in decode the Mamba mixer's whole
    step, attention over the KV cache, the norms, the router and the experts).
    kernels: use the platform's kernel backend where it runs (on CPUs: `granite_jax.cpu`). The kernels are for
    inference: differentiate with kernels=False.
    pack_weights: let the kernel backend keep copies of the weights in its own layout (on CPUs: for decode steps of
    2-16 rows, as much memory again as those weights). None: when they fit in half the free memory.
    platform: the JAX platform ("cpu", "gpu") the program is for, whose kernel backend `kernels` turns on. None: JAX's
    default backend; set it to compile for another, as for an H200 from a machine without one.
    remat: recompute each decoder layer's activations in the backward pass instead of keeping them (`jax.checkpoint`
    per layer, for training): the layers' inputs are all a gradient keeps.
    mesh: the `jax.sharding.Mesh` the weights are placed over (`granite_jax.sharding`), whose backend runs the
    embedding and the experts on the devices holding them; over one only the platform backends in PARTITIONABLE run.
    """

    ssd: str = "xla"
    kernels: bool = True
    pack_weights: bool | None = None
    platform: str | None = None
    mesh: Any = None
    remat: bool = False

    def __post_init__(self):
        if self.ssd not in SSD_IMPLS:
            raise InputError(f"ssd: {self.ssd!r} is not one of {', '.join(SSD_IMPLS)}")
        if not isinstance(self.kernels, bool):
            raise InputError(f"kernels: expected True or False, got {self.kernels!r}")
        if not isinstance(self.remat, bool):
            raise InputError(f"remat: expected True or False, got {self.remat!r}")
        if self.pack_weights not in (None, True, False):
            raise InputError(f"pack_weights: expected None, True or False, got {self.pack_weights!r}")
        if self.platform is not None and self.platform not in PLATFORM_KERNELS:
            raise InputError(f"platform: {self.platform!r} is not one of None, {', '.join(PLATFORM_KERNELS)}")
        if self.mesh is not None and self.ssd == "pallas":
            raise InputError("ssd: the Pallas SSD does not run over a mesh: use 'xla'")

    def replace(self, **changes: Any) -> Runtime:
        return dataclasses.replace(self, **changes)

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends consulted, first to last."""
        ssd = () if self.ssd == "xla" else (self.ssd,)
        platform = PLATFORM_KERNELS.get(self.platform or jax.default_backend()) if self.kernels else None
        if self.mesh is not None:
            return (*ssd, "mesh") + ((platform,) if platform in PARTITIONABLE else ())
        return ssd + ((platform,) if platform else ())


@dataclasses.dataclass
class Backend:
    """Implementations by op name, each with the ops it also does the work of. `available()`: why it cannot run here
    (None: it can). `prepare(model, rows)`: its arrays derived from the weights for steps of `rows` rows. `describe()`:
    what it runs, for records."""

    name: str
    impls: dict[str, tuple[Callable, frozenset[str]]] = dataclasses.field(default_factory=dict)
    available: Callable[[], str | None] = lambda: None
    prepare: Callable[[Any, int], dict[str, jax.Array]] = lambda model, rows: {}
    describe: Callable[[], str] = lambda: ""
    widens_weights: bool = False  # its products take bfloat16 weights under float32 arithmetic without copying them


_REGISTRY: dict[str, Backend] = {}
_RUNTIME: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("granite_jax_runtime", default=None)
_COMPANIONS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("granite_jax_companions", default=None)


def backend(name: str) -> Backend:
    """The backend `name`, created empty on first mention (its module fills it in)."""
    return _REGISTRY.setdefault(name, Backend(name))


def replaceable(fn: Callable) -> Callable:
    """Mark a plain-JAX function (or method) as an op that backends may replace."""

    @functools.wraps(fn)
    def op(*args, **kwargs):
        impl = _chosen(fn.__qualname__)
        return fn(*args, **kwargs) if impl is None else impl(fn, *args, **kwargs)

    return op


def register(backend_name: str, op: Callable, impl: Callable, *, covers: tuple[Callable, ...] = ()) -> None:
    """`impl(reference, *args, **kwargs)` runs `op` (a `replaceable`) on `backend_name`, `reference` being its plain-JAX
    body. `covers`: ops whose work it does too (a fused kernel); it is passed over where an earlier backend of the
    runtime replaces one of them."""
    covered = frozenset(c.__qualname__ for c in covers)
    backend(backend_name).impls[op.__qualname__] = (impl, covered)


@contextlib.contextmanager
def using(runtime: Runtime) -> Iterator[Runtime]:
    """Trace with `runtime`'s choices."""
    token = _RUNTIME.set(runtime)
    try:
        yield runtime
    finally:
        _RUNTIME.reset(token)


def current() -> Runtime:
    return _RUNTIME.get() or Runtime()


def under(runtime: Runtime, fn: Callable) -> Callable:
    """`fn` that traces with `runtime`'s choices. Wrap a plain function (not a model, whose own runtime applies) in it
    before `jax.jit`: jit's cache does not see `using`, so a function traced under one runtime would be reused under
    another."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with using(runtime):
            return fn(*args, **kwargs)

    return traced


def _chosen(op: str) -> Callable | None:
    replaced: set[str] = set()
    for found in filter(None, map(loaded, current().backends)):
        impl, covers = found.impls.get(op, (None, frozenset()))
        if impl is not None and not covers & replaced:
            return impl
        replaced |= found.impls.keys()
    return None


@functools.cache
def loaded(name: str) -> Backend | None:
    """The backend `name`, its module imported, if it can run here (else None, the reason logged once)."""
    try:
        importlib.import_module(BACKENDS[name])
    except ImportError as e:
        log.warning("granite_jax: the %s backend is not installed (%s); running plain JAX", name, e)
        return None
    found = backend(name)
    reason = found.available()
    if reason is not None:
        log.info("granite_jax: the %s backend does not run here (%s)", name, reason)
        return None
    return found


def widens_weights(runtime: Runtime) -> bool:
    """Whether a backend of `runtime` runs here whose products widen bfloat16 weights without copying them."""
    return any(b is not None and b.widens_weights for b in map(loaded, runtime.backends))


def describe(runtime: Runtime) -> str:
    """What runs besides plain JAX under `runtime`, for records."""
    found = [(name, loaded(name)) for name in runtime.backends]
    parts = [f"{name}: {b.describe() or 'on'}" if b else f"{name}: not running here" for name, b in found]
    return "; ".join(parts) or "plain JAX"


# ---------------------------------------------------------------------------------------------- derived weights


def prepare(model: Any, rows: int) -> Prepared:
    """What each backend of `model.runtime` derives from its weights for steps of `rows` rows, to pass into a jitted
    step beside the weights (`bound`)."""
    found = {name: loaded(name) for name in model.runtime.backends}
    return {name: b.prepare(model, rows) for name, b in found.items() if b is not None}


@contextlib.contextmanager
def bound(model: Any, prepared: Prepared) -> Iterator[None]:
    """While tracing `model` (its weights this trace's values), let `companion` find each weight's prepared arrays.
    Matched by identity: a weight is one traced value wherever the model reads it."""
    from flax import nnx

    by_id: dict[int, dict[str, jax.Array]] = {}
    if any(prepared.values()):
        for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            key = ".".join(map(str, path))
            for name, arrays in prepared.items():
                if key in arrays:
                    by_id.setdefault(id(param[...]), {})[name] = arrays[key]
    token = _COMPANIONS.set(by_id)
    try:
        yield
    finally:
        _COMPANIONS.reset(token)


def companion(weight: jax.Array, backend_name: str) -> jax.Array | None:
    """The array `backend_name` prepared from `weight` (see `bound`), or None."""
    return (_COMPANIONS.get() or {}).get(id(weight), {}).get(backend_name)
