"""Build, cache and load the kernels' library, and register its FFI targets with XLA.

The C++ sources in `csrc/` are compiled once per (sources, flags, compiler, jaxlib) with the system C++ compiler into
``$GRANITE_JAX_CACHE_DIR`` (default ``~/.cache/granite_jax``) and reused. They need Linux on x86-64 with AVX2 and FMA;
on CPUs with AVX-512F the panel kernel uses it too (``GRANITE_JAX_CPU_AVX512=0`` declines). Nothing is built where
JAX's default backend is not the CPU, or with ``GRANITE_JAX_CPU_KERNELS=0``: `unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("small_matmul.cc", "ssm_update.cc", "decode_attention.cc", "greedy.cc"))
HEADERS = (CSRC / "parallel.h",)
FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC")
AVX512_FLAGS = ("-mavx512f",)  # where the CPU has AVX-512F: the panel kernel then takes four panels at once
LOCK = ".build.lock"  # in the cache directory, held while a library is built
TARGETS = (
    "granite_small_matmul",
    "granite_matvec",
    "granite_expert_matvec",
    "granite_widen",
    "granite_take_rows",
    "granite_greedy",
    "granite_ssm_update_f32",
    "granite_mamba_step",
    "granite_decode_attention",
)

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_LIBRARY: list[ctypes.CDLL] = []  # the loaded library, once built


def available() -> bool:
    """Whether the kernels run here (compiles and loads them on the first call)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the kernels are not used (None when they are)."""
    with _LOCK:  # one build and one registration even when threads trace at once
        return _build_and_register()


def panels_use_avx512() -> bool:
    """Whether the loaded library's panel kernel takes its AVX-512 path (False where the kernels are not used)."""
    return available() and bool(_LIBRARY[0].granite_panels_avx512())


@functools.cache
def _build_and_register() -> str | None:
    reason = _unsupported()
    if reason is not None:
        log.info("granite_jax.cpu: using XLA (%s)", reason)
        return reason
    try:
        try:
            library = ctypes.CDLL(str(compiled_library(_flags())))
        except subprocess.CalledProcessError as e:  # a compiler without AVX-512: the AVX2 build
            if _flags() == FLAGS:
                raise
            detail = (e.stderr or "").strip().splitlines()[-1:]
            log.warning("granite_jax.cpu: the AVX-512 build failed (%s); building for AVX2", *detail or ["?"])
            library = ctypes.CDLL(str(compiled_library(FLAGS)))
        for target in TARGETS:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
        _LIBRARY.append(library)
    except (OSError, subprocess.CalledProcessError, AttributeError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        reason = f"could not build or load {_names()}: {detail[-1] if detail else type(e).__name__}"
        log.warning("granite_jax.cpu: using XLA (%s)", reason)  # expected to work here: say so
    return reason


def _unsupported() -> str | None:
    if os.environ.get("GRANITE_JAX_CPU_KERNELS", "1") == "0":
        return "disabled by GRANITE_JAX_CPU_KERNELS=0"
    if jax.default_backend() != "cpu":
        return f"JAX's default backend is {jax.default_backend()}, not cpu"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64, this is {platform.system()} on {platform.machine()}"
    if not {"avx2", "fma"} <= cpu_flags():
        return "the CPU lacks AVX2 or FMA"
    if compiler() is None:
        return "no C++ compiler (set CXX, or install g++)"
    return None


def cpuinfo(field: str) -> str | None:
    """The first value of `field` ("flags", "model name", ...) in Linux's /proc/cpuinfo; None elsewhere or if absent."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def cpu_flags() -> set[str]:
    return set((cpuinfo("flags") or "").split())


def _flags() -> tuple[str, ...]:
    """`FLAGS`, plus `AVX512_FLAGS` where the CPU has AVX-512F and GRANITE_JAX_CPU_AVX512 is not 0."""
    avx512 = "avx512f" in cpu_flags() and os.environ.get("GRANITE_JAX_CPU_AVX512", "1") != "0"
    return FLAGS + AVX512_FLAGS if avx512 else FLAGS


def compiler() -> str | None:
    return next(filter(None, (shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++"))), None)


def cache_dir() -> Path:
    return Path(os.environ.get("GRANITE_JAX_CACHE_DIR") or Path.home() / ".cache" / "granite_jax")


def _names() -> str:
    return " + ".join(source.name for source in SOURCES)


def _run_compiler(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def compiled_library(flags: tuple[str, ...]) -> Path:
    """The kernels' shared library, compiled once per (sources, flags, compiler, jaxlib) and reused."""
    cxx = compiler()
    include = jax.ffi.include_dir()
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *flags, str(cxx), jax.__version__, include]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / LOCK, "w") as lock:  # processes starting at once build it once, not each
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _build(cxx, flags, include, target)
    return target


def _build(cxx: str, flags: tuple[str, ...], include: str, target: Path) -> None:
    log.info("granite_jax.cpu: compiling %s -> %s", _names(), target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # then an atomic rename: no half-written library
        built = Path(tmp) / target.name
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        # One compiler per source at once (each spends most of its time parsing the FFI headers), then one link.
        compiles = [[cxx, *flags, "-c", f"-I{include}", str(s), "-o", str(o)] for s, o in zip(SOURCES, objects)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            list(pool.map(_run_compiler, compiles))
        _run_compiler([cxx, *flags, *map(str, objects), "-o", str(built)])
        os.replace(built, target)
