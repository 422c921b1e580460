"""y = x W^T for the few rows of a decode step, with a CPU kernel where XLA's own product is slow.

Decoding multiplies 1-16 rows of activations by every weight matrix, once per token: the step is bound by reading
the weights. XLA:CPU reaches that bound at one row but runs 2-16 rows as library GEMMs at a third of the memory
bandwidth (docs/generation.md). `linear` sends such products, in float32 on x86-64 CPUs with AVX2 and FMA, to a
small C++ kernel (`csrc/small_matmul.cc`, an XLA FFI custom call) that streams W once; everything else, and every
other platform, gets `lax.dot_general`.

The kernel is compiled with the system C++ compiler on first use and cached (``$GRANITE_JAX_CACHE_DIR`` or
``~/.cache/granite_jax``). Without a compiler, on another CPU, or with ``GRANITE_JAX_CPU_MATMUL=0``, `linear` is
`lax.dot_general` everywhere; `unavailable_reason()` says why. It is not built where JAX's default backend is not the
CPU; where it is, `lax.platform_dependent` still lowers XLA's product for any other platform (so a function exported
for several platforms carries both, and its CPU branch needs this module's target registered where it is loaded).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

MIN_ROWS, MAX_ROWS = 2, 16  # other products are left to XLA: one row (its matrix-vector product is fast), prefill
TARGET = "granite_small_matmul_f32"
SOURCE = Path(__file__).parent / "csrc" / "small_matmul.cc"
FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC")

log = logging.getLogger(__name__)


def dot(x: Array, w: Array) -> Array:
    """x (..., K) contracted with w (N, K) over K: (..., N), by XLA."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def linear(x: Array, w: Array) -> Array:
    """x (..., K) @ w (N, K)^T -> (..., N): the CPU kernel for float32 products of MIN_ROWS..MAX_ROWS rows, else XLA."""
    if not uses_kernel(x, w):
        return dot(x, w)
    # Chosen when lowering: the kernel on CPU, XLA's product on every other platform.
    return lax.platform_dependent(x, w, cpu=_kernel, default=dot)


def uses_kernel(x: Array, w: Array) -> bool:
    """Whether `linear(x, w)` runs the kernel when lowered for a CPU."""
    rows = math.prod(x.shape[:-1])
    return x.dtype == w.dtype == jnp.float32 and MIN_ROWS <= rows <= MAX_ROWS and w.ndim == 2 and available()


@jax.custom_jvp
def _kernel(x: Array, w: Array) -> Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


@_kernel.defjvp
def _kernel_jvp(primals, tangents):
    # The product is bilinear; its tangent is written with XLA products, which JAX can transpose (gradients).
    (x, w), (dx, dw) = primals, tangents
    return _kernel(x, w), dot(dx, w) + dot(x, dw)


def available() -> bool:
    """Whether `linear` can use the kernel here (compiles and loads it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the kernel is not used (None when it is)."""
    return _load()


def describe() -> str:
    """What runs CPU products of MIN_ROWS..MAX_ROWS float32 rows here, for benchmark records."""
    reason = _load()
    return f"cpu_matmul kernel ({MIN_ROWS}-{MAX_ROWS} rows, float32)" if reason is None else f"XLA ({reason})"


_LOCK = threading.Lock()


def _load() -> str | None:
    with _LOCK:  # one build and one registration even when threads trace at once
        return _build_and_register()


@functools.cache
def _build_and_register() -> str | None:
    reason = _unsupported()
    if reason is not None:
        log.info("granite_jax.cpu_matmul: using XLA's products (%s)", reason)
        return reason
    try:
        library = ctypes.CDLL(str(_compiled_library()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, TARGET)), platform="cpu")
    except (OSError, subprocess.CalledProcessError, AttributeError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        reason = f"could not build or load {SOURCE.name}: {detail[-1] if detail else type(e).__name__}"
        log.warning("granite_jax.cpu_matmul: using XLA's products (%s)", reason)  # expected to work here: say so
    return reason


def _unsupported() -> str | None:
    if os.environ.get("GRANITE_JAX_CPU_MATMUL", "1") == "0":
        return "disabled by GRANITE_JAX_CPU_MATMUL=0"
    if jax.default_backend() != "cpu":
        return f"JAX's default backend is {jax.default_backend()}, not cpu"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64, this is {platform.system()} on {platform.machine()}"
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return "the CPU lacks AVX2 or FMA"
    if _compiler() is None:
        return "no C++ compiler (set CXX, or install g++)"
    return None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    return next(filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++"))), None)


def cache_dir() -> Path:
    return Path(os.environ.get("GRANITE_JAX_CACHE_DIR") or Path.home() / ".cache" / "granite_jax")


def _compiled_library() -> Path:
    """The kernel's shared library, compiled once per (source, flags, compiler, jaxlib) and reused."""
    compiler = _compiler()
    include = jax.ffi.include_dir()
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), *FLAGS, str(compiler), jax.__version__, include]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"small_matmul-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("granite_jax.cpu_matmul: compiling %s -> %s", SOURCE.name, target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # then an atomic rename: safe with parallel builds
        built = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(built)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(built, target)
    return target
