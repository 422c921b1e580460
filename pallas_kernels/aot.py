"""Compile the kernels for an NVIDIA GPU that is not attached (ahead-of-time, "deviceless").

`jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))` only checks the Pallas -> Triton IR lowering. Compiling
the lowered module goes on through Triton (TTIR -> TTGIR -> LLVM -> PTX) and ptxas, which is where tile sizes meet
the hardware: shared memory and register limits, layouts, unsupported dot shapes. XLA's GPU compiler can do that
without a GPU from a target description, given the CUDA PJRT plugin (`pip install jax-cuda12-pjrt==<jax version>
jax-cuda12-plugin==<jax version>`, no GPU or driver needed). Without the plugin `gpu_device()` raises
`AotUnavailableError` and the tests that use it skip.

The device descriptions below are the public hardware figures of the SXM parts (SM count, memory, shared memory per
block and per SM, registers, clocks); XLA uses them for the compile target, and the H200 differs from the H100 only in
memory size and bandwidth, not in anything the kernels' compilation depends on.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

import jax

# GpuTargetConfigProto text, one per GPU. Compute capability 9.0 (sm_90) for H100/H200, 8.0 for A100.
_SM90_LIMITS = """
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  cuda_compute_capability { major: 9 minor: 0 }
"""
TARGETS: dict[str, str] = {
    "h100": "gpu_device_info {"
    + _SM90_LIMITS
    + """
  memory_bandwidth: 3352000000000
  device_memory_size: 85520809984
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
""",
    "h200": "gpu_device_info {"
    + _SM90_LIMITS
    + """
  memory_bandwidth: 4800000000000
  device_memory_size: 150754820096
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
""",
    "a100": """gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 166912
  shared_memory_per_core: 167936
  threads_per_core_limit: 2048
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  core_count: 108
  fpus_per_core: 64
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 2039000000000
  l2_cache_size: 41943040
  clock_rate_ghz: 1.41
  device_memory_size: 85899345920
  cuda_compute_capability { major: 8 minor: 0 }
}
platform_name: "CUDA"
device_description_str: "NVIDIA A100-SXM4-80GB"
""",
}


class AotUnavailableError(RuntimeError):
    """The CUDA PJRT plugin needed for deviceless compilation is not installed."""


def gpu_device(gpu: str = "h200") -> Any:
    """A compile-only CUDA device for `gpu` ("h100", "h200" or "a100")."""
    return gpu_devices(1, gpu)[0]


@functools.cache
def gpu_devices(count: int, gpu: str = "h200") -> list[Any]:
    """`count` compile-only CUDA devices of one host (a mesh of them compiles SPMD programs with their collectives)."""
    from jax._src import xla_bridge

    if shutil.which("ptxas") is None:
        raise AotUnavailableError("deviceless CUDA compilation needs ptxas (the CUDA toolkit's assembler) on PATH")
    try:
        topology = xla_bridge.make_pjrt_topology("cuda", "", topology=f"1x1x{count}", target_config=TARGETS[gpu])
    except (RuntimeError, ValueError, KeyError) as e:
        raise AotUnavailableError(
            f"deviceless CUDA compilation is unavailable ({type(e).__name__}: {e}); it needs the jax-cuda12-pjrt "
            "and jax-cuda12-plugin packages matching the installed jax"
        ) from None
    return list(topology._make_compile_only_devices())


def compile_for_gpu(fn, *args, gpu: str = "h200"):
    """Lower and compile `fn(*args)` for `gpu`; run it inside `pallas_kernels.cuda_lowering()`. `args` are pytrees
    of shape structs (or arrays: only their shapes and dtypes are used).

    Returns the compiled executable (for `.as_text()`, `.cost_analysis()`); raises on any lowering or compile error.
    """
    return lower_for_gpu(fn, args, gpu).compile()


def lower_for_gpu(fn, args, gpu: str = "h200", donate_argnums: tuple[int, ...] = ()):
    """`fn(*args)` jitted and lowered for `gpu`, its arguments placed on the compile-only device, or kept over the mesh
    of compile-only devices their shardings name (for `pallas_kernels.executable.launches`). `donate_argnums` as for
    `jax.jit`: without the donation a caller makes, XLA copies the buffers it would update in place."""
    return jax.jit(fn, donate_argnums=donate_argnums).trace(*_placed(args, gpu)).lower(lowering_platforms=("cuda",))


def _placed(args, gpu: str):
    single = jax.sharding.SingleDeviceSharding(gpu_device(gpu))

    def place(a):
        keep = isinstance(getattr(a, "sharding", None), jax.sharding.NamedSharding)
        return a if keep else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=single)

    return jax.tree.map(place, args)


# ---------------------------------------------------------------------------------------------- static report


def kernel_report(fn, *args: jax.ShapeDtypeStruct, gpu: str = "h200") -> list[dict]:
    """Compile `fn(*args)` for `gpu` and describe each Pallas kernel: grid, threads, shared memory, and (when `ptxas`
    is on PATH) registers per thread and spill bytes. Run inside `pallas_kernels.cuda_lowering()`.

    A static signal for choosing tile sizes without a GPU: occupancy follows from registers x threads and shared memory,
    spills are a red flag, and the grid shows how many CTAs there are to spread over the SMs.
    """
    arch = "sm_90a" if gpu in ("h100", "h200") else "sm_80"
    with tempfile.TemporaryDirectory() as dump:
        thunks = _compile_with_dump(lower_for_gpu(fn, args, gpu), dump)
        ptx = {f: open(os.path.join(dump, f)).read() for f in os.listdir(dump) if f.endswith(".ptx")}
        kernels = []
        for m in re.finditer(
            r"kCustomKernel .*?\] (\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+)", thunks
        ):
            name, grid, threads, smem = m.groups()
            entry = dict(name=name, grid=[int(v) for v in grid.split(",")], threads=int(threads.split(",")[0]),
                         shared_memory=int(smem))  # fmt: skip
            source = next((f for f, text in ptx.items() if f".entry {name}(" in text), None)
            if source and shutil.which("ptxas"):
                path = os.path.join(dump, source)
                out = subprocess.run(["ptxas", "-v", f"-arch={arch}", path, "-o", os.devnull],
                                     capture_output=True, text=True).stderr  # fmt: skip
                regs = re.search(r"Used (\d+) registers", out)
                spills = re.search(r"(\d+) bytes spill stores", out)
                entry.update(
                    registers=int(regs.group(1)) if regs else None, spill_bytes=int(spills.group(1)) if spills else None
                )
                entry["wgmma"] = "wgmma" in ptx[source]
            kernels.append(entry)
    return kernels


def _compile_with_dump(lowered, dump: str) -> str:
    """Compile `lowered` with XLA's dump (HLO, thunk sequence, PTX) written into `dump`; the thunk sequence's text."""
    lowered.compile(compiler_options={"xla_dump_to": dump})
    names = sorted(f for f in os.listdir(dump) if f.endswith("thunk_sequence.txt"))
    return "".join(open(os.path.join(dump, f)).read() for f in names)
