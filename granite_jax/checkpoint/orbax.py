"""Orbax checkpoints of a `Granite` model: save atomically, restore straight to the requested dtype.

Layout of a checkpoint directory::

    DIR/config.json                     the Hugging Face config (transformers can read it too)
    DIR/tokenizer.json, ...             tokenizer and other small files copied from the source
    DIR/state/                          orbax: `nnx.to_pure_dict(nnx.state(model))`
    DIR/granite_jax_checkpoint.json     completion marker, written last

Everything is written into a hidden sibling directory, `.DIR.partial-PID`, that is renamed to DIR only once the marker
is in place, so an interrupted save leaves no directory that could be taken as a complete checkpoint; loading a
directory with `state/` but without the marker is refused. An interrupted save removes its partial directory; one left
by a killed process names its writer in an owner file, so that the next conversion into DIR can tell whether it was
abandoned (`remove_abandoned_partials`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from granite_jax.checkpoint.hf import flatten, load_config, unflatten
from granite_jax.config import ModelConfig, read_json_object
from granite_jax.errors import CheckpointError
from granite_jax.model import Granite, abstract_model, count_params, is_float8, weight_dtype, with_float8_weights
from granite_jax.ops import Runtime
from granite_jax.sharding import (
    divides,
    parameter_shardings,
    relaid,
    relayout_spec,
    row_blocks,
    shard_model,
    to_blocks,
    transformers_order,
    transformers_shape,
)

MARKER = "granite_jax_checkpoint.json"
PARTIAL_OWNER = ".granite_jax_partial.json"  # in a partial save only: the pid and host of the process writing it
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
    Everything is written into `partial_dir(out_dir)`, removed if anything (an interrupt included) stops the save.
    """
    out = os.path.abspath(os.fspath(out_dir))
    check_writable(out)
    tmp = _make_partial_dir(out)
    try:
        _write_state(model, os.path.join(tmp, STATE_DIR))
        copied = _copy_side_files(copy_from, tmp) if copy_from is not None else []
        if "config.json" not in copied:
            _write_json(os.path.join(tmp, "config.json"), model.cfg.to_hf_dict())
        _write_json(os.path.join(tmp, MARKER), _marker(model, source or (copy_from and os.fspath(copy_from))))
        os.remove(os.path.join(tmp, PARTIAL_OWNER))  # only a partial save says who writes it
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_writable(out_dir: str | os.PathLike) -> None:
    """Refuse an output path that is a file or a non-empty directory, or whose parent cannot take it."""
    out = os.fspath(out_dir)
    try:
        entries = os.listdir(out) if os.path.isdir(out) else []
    except OSError as e:
        raise CheckpointError(f"{out}: cannot read the output directory ({e.strerror})") from None
    if entries:
        raise CheckpointError(f"{out}: output directory is not empty; choose a new directory or empty this one")
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointError(f"{out}: exists and is not a directory")
    ancestor = os.path.dirname(os.path.abspath(out))  # the directories up to the nearest existing one are created
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        raise CheckpointError(f"{out}: cannot create it in {ancestor} (not a writable directory)")


def partial_dir(out_dir: str | os.PathLike, pid: int | None = None) -> str:
    """The hidden sibling `.NAME.partial-PID` in which process `pid` (default: this one) writes a save into `out_dir`.

    The pid in the name lets the writer find its own directory again after an interrupt wherever it landed (even
    between creating it and knowing its name), and keeps concurrent writers apart."""
    out = os.path.abspath(os.fspath(out_dir))
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial-{pid or os.getpid()}")


def remove_abandoned_partials(out_dir: str | os.PathLike) -> list[str]:
    """Remove the partial saves into `out_dir` whose writer is gone, and return their paths; refuse any other.

    A save killed where nothing can clean up (SIGKILL, a crash, power loss) leaves its `.NAME.partial-*` sibling
    behind. It is removed only when its owner file (`PARTIAL_OWNER`) says it was written on this host by a process that
    no longer exists: then nothing will ever finish it. One whose writer is still running may be a conversion into the
    same target, and one without a readable owner file (written on another host sharing the file system, or by an
    older granite-jax) cannot be told from one; removing either could destroy work in progress, so the error says why
    and gives the command that removes it, and the user decides.
    """
    out = os.path.abspath(os.fspath(out_dir))
    removed = []
    for path in _partial_dirs(out):
        reason = _why_not_abandoned(path)
        if reason is None:
            try:
                shutil.rmtree(path)
                removed.append(path)
                continue
            except OSError as e:
                reason = f"a partial conversion left by an interrupted run, which cannot be removed ({e.strerror})"
        raise CheckpointError(
            f"{path}: {reason}; if no conversion into {out} is running, remove it: rm -rf {shlex.quote(path)}"
        )
    return removed


def _partial_dirs(out: str) -> list[str]:
    parent, name = os.path.dirname(out), os.path.basename(out)
    pattern = re.compile(rf"\.{re.escape(name)}\.partial-[^.]+")  # not the partials of `NAME.partial-X`, a sibling
    try:
        names = sorted(os.listdir(parent))
    except OSError:  # no parent yet: no partial either
        return []
    return [os.path.join(parent, n) for n in names if pattern.fullmatch(n) and os.path.isdir(os.path.join(parent, n))]


def _why_not_abandoned(path: str) -> str | None:
    """None if the partial save `path` was written on this host by a process that has ended; else why it may not be."""
    try:
        owner = read_json_object(os.path.join(path, PARTIAL_OWNER), CheckpointError)
    except CheckpointError:
        return "a partial conversion whose writer is unknown (it has no readable owner file)"
    pid, host = owner.get("pid"), owner.get("host")
    if host != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return f"a partial conversion written by process {pid} on host {host}, which cannot be checked from here"
    if _running(pid):
        return f"a partial conversion by process {pid}, which is running"
    return None


def _running(pid: int) -> bool:
    if pid == os.getpid():  # this process writes no save yet: a directory with its pid is an earlier process's
        return False
    if os.name != "posix":  # os.kill(pid, 0) is a liveness probe on POSIX only
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _make_partial_dir(out: str) -> str:
    """Create this process's partial directory for `out`, with the owner file `remove_abandoned_partials` reads."""
    parent, tmp = os.path.dirname(out), partial_dir(out)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{out}: cannot create its parent directory ({e.strerror})") from None
    try:
        os.mkdir(tmp)  # the umask applies: the finished checkpoint looks like any new directory
    except FileExistsError:
        raise CheckpointError(
            f"{tmp}: a partial save left by an earlier process with this pid; remove it: rm -rf {shlex.quote(tmp)}"
        ) from None
    except OSError as e:  # what check_writable cannot see (root on a read-only file system, say)
        raise CheckpointError(f"{out}: cannot write in {parent} ({e.strerror})") from None
    try:
        _write_json(os.path.join(tmp, PARTIAL_OWNER), {"pid": os.getpid(), "host": socket.gethostname()})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _write_state(model: Granite, path: str) -> None:
    state = unflatten(transformers_order(model))  # one layout on disk, whatever the mesh the model ran over
    with _interrupts_deferred(), _quiet_orbax(), _checkpointer() as ck:
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


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold SIGINT and SIGTERM back while orbax writes; once it is done, deliver the first to the handler before.

    Orbax writes from worker threads, which a KeyboardInterrupt in the main thread does not stop: they would go on
    writing into the directory the interrupted save removes, re-create parts of it, and print a traceback each as
    they fail. Only the main thread may set signal handlers; elsewhere nothing is deferred.
    """
    signals = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, signals):
        yield  # (None: a handler set outside Python, which could not be put back)
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if held:
            signal.raise_signal(held[0])


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
    mesh: jax.sharding.Mesh | None = None,
) -> Granite:
    """Restore a `Granite` from an orbax checkpoint directory; parameters are read straight into `param_dtype`, and
    over `mesh` straight into their shards (`granite_jax.sharding`)."""
    d = os.fspath(model_dir)
    stored = read_marker(d).get("param_dtype")
    cfg = cfg or load_config(d)
    param_dtype = param_dtype or dtype
    if is_float8(param_dtype) and stored != "float8":  # a wider checkpoint: restored as it is, then quantized
        wide = jnp.bfloat16 if stored == "bfloat16" else jnp.float32
        wide_model = restore_model(d, dtype=dtype, param_dtype=wide, runtime=runtime, cfg=cfg, mesh=mesh)
        return with_float8_weights(wide_model) if mesh is None else shard_model(with_float8_weights(wide_model), mesh)
    blocks = row_blocks(mesh)
    graphdef, state = nnx.split(abstract_model(cfg, dtype=dtype, param_dtype=param_dtype, runtime=runtime,
                                               row_blocks=blocks))  # fmt: skip
    params = flatten(nnx.to_pure_dict(state))
    saved = {k: transformers_shape(cfg, blocks, k, x.shape) for k, x in params.items()}
    placement = _restore_placement(saved, mesh)
    target = unflatten({k: jax.ShapeDtypeStruct(saved[k], x.dtype, sharding=placement[k]) for k, x in params.items()})
    try:
        with _quiet_orbax(), _abandoned_reads_ignored(), _checkpointer() as ck:
            restored = ck.restore(os.path.join(d, STATE_DIR), target)
    except Exception as e:  # orbax raises ValueError/KeyError/FileNotFoundError with long messages
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(" See full TensorStore details")[0]  # the rest is a repr of a bound method
        raise CheckpointError(f"{d}: cannot restore the orbax state for this config ({first})") from None
    if mesh is not None:  # each row block to its device, one tensor at a time (the restored one freed as it goes)
        flat = flatten(restored)
        del restored
        for k, sharding in parameter_shardings(params, mesh).items():
            if relaid(k, blocks):
                flat[k] = jax.jit(functools.partial(to_blocks, cfg, blocks, k), out_shardings=sharding)(flat.pop(k))
        restored = unflatten(flat)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def _restore_placement(
    shapes: dict[str, tuple[int, ...]], mesh: jax.sharding.Mesh | None
) -> dict[str, jax.sharding.Sharding]:
    """Where each stored tensor is restored: its shards (`sharding.parameter_spec`), a tensor laid out in blocks after
    the restore split where its reordering is local (`sharding.relayout_spec`); whole on each device where that
    split would not divide it."""
    if mesh is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return {k: single for k in shapes}
    placement = {}
    for k, shape in shapes.items():
        placed = jax.sharding.NamedSharding(mesh, relayout_spec(k, shape, mesh))
        placement[k] = (
            placed if divides(shape, placed) else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        )
    return placement


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
