"""Orbax checkpoints of a `Granite` model: save atomically, restore straight to the requested dtype.

Layout of a checkpoint directory::

    DIR/config.json                     the Hugging Face config (transformers can read it too)
    DIR/tokenizer.json, ...             tokenizer and other small files copied from the source
    DIR/state/                          orbax: `nnx.to_pure_dict(nnx.state(model))`
    DIR/granite_jax_checkpoint.json     completion marker, written last

Everything is written into a hidden sibling directory that is renamed to DIR only once the marker is in place, so an
interrupted save leaves no directory that could be taken as a complete checkpoint; loading a directory with `state/`
but without the marker is refused.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from granite_jax.checkpoint.hf import load_config
from granite_jax.config import ModelConfig, read_json_object
from granite_jax.errors import CheckpointError
from granite_jax.model import Granite, abstract_model, count_params, weight_dtype
from granite_jax.ops import Runtime

MARKER = "granite_jax_checkpoint.json"
STATE_DIR = "state"
FORMAT = "granite-jax-orbax"
VERSION = 2  # 2: linear weights stored (out, in)
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".ckpt", ".h5")


def is_orbax_checkpoint(model_dir: str | os.PathLike) -> bool:
    """True if the directory is (or was meant to become) a granite-jax orbax checkpoint, complete or not."""
    d = os.fspath(model_dir)
    return os.path.isfile(os.path.join(d, MARKER)) or os.path.isdir(os.path.join(d, STATE_DIR))


def read_marker(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of an orbax checkpoint; a clear error if the checkpoint is incomplete or foreign."""
    d = os.fspath(model_dir)
    if not os.path.isdir(d):
        raise CheckpointError(f"{d}: model directory not found")
    path = os.path.join(d, MARKER)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{d}: incomplete orbax checkpoint (no {MARKER}); the conversion was interrupted. "
            "Delete the directory and run `python -m granite_jax.convert` again"
        )
    marker = read_json_object(path, CheckpointError)
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a granite-jax orbax checkpoint (format {marker.get('format')!r})")
    if marker.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: granite-jax orbax checkpoint version {marker.get('version')!r}, this granite-jax reads version "
            f"{VERSION}; convert the Hugging Face checkpoint again with `python -m granite_jax.convert`"
        )
    if not os.path.isdir(os.path.join(d, STATE_DIR)):
        raise CheckpointError(f"{d}: the marker is there but {STATE_DIR}/ is missing")
    return marker


# ---------------------------------------------------------------------------------------------- save


def save_checkpoint(
    model: Granite,
    out_dir: str | os.PathLike,
    *,
    copy_from: str | os.PathLike | None = None,
    source: str | None = None,
) -> str:
    """Write `model` as an orbax checkpoint into `out_dir`, which must not exist or be empty. Returns `out_dir`.

    `copy_from`: a Hugging Face checkpoint directory whose non-weight files (config.json, tokenizer, chat template,
    generation config) are copied beside the weights; without it, config.json is written from `model.cfg`.
    """
    out = os.path.abspath(os.fspath(out_dir))
    check_writable(out)
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{out}: cannot create its parent directory ({e.strerror})") from None
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    except OSError as e:  # what check_writable cannot see (root on a read-only file system, say)
        raise CheckpointError(f"{out}: cannot write in {parent} ({e.strerror})") from None
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result should look like any new directory
    try:
        _write_state(model, os.path.join(tmp, STATE_DIR))
        copied = _copy_side_files(copy_from, tmp) if copy_from is not None else []
        if "config.json" not in copied:
            _write_json(os.path.join(tmp, "config.json"), model.cfg.to_hf_dict())
        _write_json(os.path.join(tmp, MARKER), _marker(model, source or (copy_from and os.fspath(copy_from))))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_writable(out_dir: str | os.PathLike) -> None:
    """Refuse an output path that is a file or a non-empty directory, or whose parent cannot take it."""
    out = os.fspath(out_dir)
    if os.path.isdir(out) and os.listdir(out):
        raise CheckpointError(f"{out}: output directory is not empty; choose a new directory or empty this one")
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointError(f"{out}: exists and is not a directory")
    ancestor = os.path.dirname(os.path.abspath(out))  # the directories up to the nearest existing one are created
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        raise CheckpointError(f"{out}: cannot create it in {ancestor} (not a writable directory)")


def _write_state(model: Granite, path: str) -> None:
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with _quiet_orbax(), _checkpointer() as ck:
        ck.save(path, state)
        ck.wait_until_finished()


def _copy_side_files(src: str | os.PathLike, dst: str) -> list[str]:
    src = os.fspath(src)
    names = [n for n in sorted(os.listdir(src)) if os.path.isfile(os.path.join(src, n))]
    copied = [n for n in names if not n.endswith(WEIGHT_SUFFIXES) and not n.startswith(".") and n != MARKER]
    for name in copied:
        shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    return copied


def _marker(model: Granite, source: str | None) -> dict[str, Any]:
    return dict(
        format=FORMAT,
        version=VERSION,
        param_dtype=weight_dtype(model),
        num_params=count_params(model),
        source=source,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish(tmp: str, out: str) -> None:
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked before); rename cannot replace a directory on every platform
    try:
        os.rename(tmp, out)
    except OSError as e:
        raise CheckpointError(f"{out}: cannot move the finished checkpoint into place ({e})") from None


# ---------------------------------------------------------------------------------------------- restore


def restore_model(
    model_dir: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    runtime: Runtime | None = None,
    cfg: ModelConfig | None = None,
) -> Granite:
    """Restore a `Granite` from an orbax checkpoint directory; parameters are read straight into `param_dtype`."""
    d = os.fspath(model_dir)
    read_marker(d)
    cfg = cfg or load_config(d)
    param_dtype = param_dtype or dtype
    graphdef, state = nnx.split(abstract_model(cfg, dtype=dtype, param_dtype=param_dtype, runtime=runtime))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), nnx.to_pure_dict(state))
    try:
        with _quiet_orbax(), _abandoned_reads_ignored(), _checkpointer() as ck:
            restored = ck.restore(os.path.join(d, STATE_DIR), target)
    except Exception as e:  # orbax raises ValueError/KeyError/FileNotFoundError with long messages
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(" See full TensorStore details")[0]  # the rest is a repr of a bound method
        raise CheckpointError(f"{d}: cannot restore the orbax state for this config ({first})") from None
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


@contextlib.contextmanager
def _abandoned_reads_ignored():
    """Keep orbax's abandoned reads from printing tracebacks around a failed restore's one-line error.

    When one array's read fails, orbax gives up on the others. Their coroutines are finalised unfinished, TensorStore's
    callbacks find the event loop closed, and their tasks die with exceptions nobody retrieved. Python reports each
    (through `sys.unraisablehook` and the `asyncio` logger) with a traceback and a TensorStore spec per tensor, during
    the restore and after it. So a hook and a logging filter that drop only those reports are installed for the
    restore; when it fails they stay for the rest of the process, when it succeeds what was there before is put back.
    """
    if getattr(sys.unraisablehook, "granite_jax", False):  # still installed after an earlier failure
        yield
        return
    previous, logger = sys.unraisablehook, logging.getLogger("asyncio")

    def hook(unraisable) -> None:
        if not _is_abandoned_read(unraisable):
            previous(unraisable)

    hook.granite_jax = True
    sys.unraisablehook = hook
    logger.addFilter(_is_not_abandoned_task)
    yield  # a failed restore raises here, and the lines below do not run
    if sys.unraisablehook is hook:
        sys.unraisablehook = previous
    logger.removeFilter(_is_not_abandoned_task)


def _is_abandoned_read(unraisable) -> bool:
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None:
        return _in_orbax(code.co_filename)
    closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
    frames = traceback.walk_tb(unraisable.exc_traceback)
    return closed and any(frame.f_code.co_name == "call_soon_threadsafe" for frame, _ in frames)


def _is_not_abandoned_task(record: logging.LogRecord) -> bool:
    """False for asyncio's "Task exception was never retrieved" (and its futures' variants) of an orbax read."""
    error = record.exc_info[1] if record.exc_info else None
    return error is None or not ("exception was never retrieved" in str(record.msg) and _raised_in_orbax(error))


def _raised_in_orbax(error: BaseException | None) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(_in_orbax(frame.f_code.co_filename) for frame, _ in traceback.walk_tb(error.__traceback__)):
            return True
        error = error.__cause__
    return False


def _in_orbax(filename: str) -> bool:
    return filename.startswith(_orbax_dir())


@functools.cache
def _orbax_dir() -> str:
    import orbax.checkpoint

    return os.path.dirname(os.path.dirname(orbax.checkpoint.__file__)) + os.sep


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs every step at INFO/WARNING through absl; keep the CLIs' output to progress bars and results."""
    from absl import logging

    level = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(level)
