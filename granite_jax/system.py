"""What this machine has free: host memory, and the default device's memory."""

from __future__ import annotations

import jax


def available_memory() -> int | None:
    """Bytes of host memory available to new allocations (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_memory() -> int | None:
    """Bytes free on the default device: an accelerator's memory statistics, else the host's `available_memory`."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # backends without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return available_memory()
