"""HF safetensors -> orbax conversion: round trip, dtype on restore, and refusal of bad or incomplete output."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from granite_jax import convert
from granite_jax.checkpoint import CheckpointError, export_safetensors, load_model, stored_dtype
from granite_jax.checkpoint import orbax as checkpoint


@pytest.fixture(scope="module")
def orbax_checkpoint(tiny_checkpoint, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("orbax") / "tiny"
    assert convert.main(["--model", tiny_checkpoint, "--out", str(out), "--quiet"]) == 0
    return str(out)


def _leaves(model):
    return jax.tree.leaves(nnx.state(model))


def test_round_trip_equals_hf_load(tiny_checkpoint, orbax_checkpoint):
    from_hf, from_orbax = load_model(tiny_checkpoint), load_model(orbax_checkpoint)
    assert len(_leaves(from_hf)) == len(_leaves(from_orbax))
    for a, b in zip(_leaves(from_hf), _leaves(from_orbax), strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_side_files_and_marker(orbax_checkpoint):
    names = set(os.listdir(orbax_checkpoint))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", checkpoint.MARKER, checkpoint.STATE_DIR} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    marker = checkpoint.read_marker(orbax_checkpoint)
    assert marker["param_dtype"] == "float32" and marker["num_params"] > 0


def test_restore_straight_to_bfloat16(orbax_checkpoint, tiny_checkpoint):
    model = load_model(orbax_checkpoint, dtype=jnp.bfloat16)
    assert {x.dtype for x in _leaves(model)} == {jnp.dtype(jnp.bfloat16)}
    reference = load_model(tiny_checkpoint, dtype=jnp.bfloat16)
    for a, b in zip(_leaves(reference), _leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_convert_to_bfloat16_storage(tiny_checkpoint, tmp_path):
    out = tmp_path / "bf16"
    convert.convert(tiny_checkpoint, out, dtype="bfloat16")
    assert checkpoint.read_marker(out)["param_dtype"] == "bfloat16" == stored_dtype(out)
    assert {x.dtype for x in _leaves(load_model(out, dtype=jnp.float32))} == {jnp.dtype(jnp.float32)}


def test_convert_keeps_the_stored_dtype_by_default(hf_checkpoint, tiny_checkpoint, tmp_path):
    assert checkpoint.read_marker(convert.convert(hf_checkpoint(dtype="bfloat16"), tmp_path / "a"))["param_dtype"] == (
        "bfloat16"
    )
    # config.json naming bfloat16 over float32 tensors: the tensors decide, nothing is narrowed
    src = tmp_path / "declared"
    shutil.copytree(tiny_checkpoint, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    assert checkpoint.read_marker(convert.convert(src, tmp_path / "b"))["param_dtype"] == "float32"


def test_non_empty_output_refused(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert convert.main(["--model", tiny_checkpoint, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not empty" in err and len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_output_that_cannot_be_created_is_refused_before_loading(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(convert, "load_model", lambda *a, **k: pytest.fail("loaded before checking the output"))
    assert convert.main(["--model", tiny_checkpoint, "--out", str(tmp_path / "a_file" / "sub" / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot create it in {tmp_path / 'a_file'}" in err, err


def test_empty_output_dir_accepted(tiny_checkpoint, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    convert.convert(tiny_checkpoint, out)
    checkpoint.read_marker(out)


@pytest.mark.parametrize(
    ("when", "out_was"),
    [("before", "missing with its parent"), ("after", "missing with its parent"), ("after", "empty")],
)
def test_an_interrupt_around_the_rename_leaves_the_output_as_it_was(
    tiny_checkpoint, tmp_path, monkeypatch, capsys, when, out_was
):
    out = tmp_path / "parent" / "out" if out_was == "missing with its parent" else tmp_path / "out"
    if out_was == "empty":
        out.mkdir()
    publish = checkpoint._publish

    def interrupted(tmp, out):
        if when == "after":
            publish(tmp, out)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(checkpoint, "_publish", interrupted)
    assert convert.main(["--model", tiny_checkpoint, "--out", str(out), "--quiet"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [convert.INTERRUPTED]
    if out_was == "empty":
        assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == []
    else:
        assert os.listdir(tmp_path) == []


class _Finaliser:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # its KeyboardInterrupt is raised here, where Python can only print it


def _swallowed_interrupt() -> None:
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:  # a library that catches everything
        pass


@pytest.mark.parametrize("where", ["finaliser", "swallowed"])
def test_an_interrupt_python_drops_still_ends_the_conversion(tmp_path, monkeypatch, capsys, where):
    def converted(model_dir, out_dir, **kwargs):
        _Finaliser() if where == "finaliser" else _swallowed_interrupt()
        return os.fspath(out_dir)

    monkeypatch.setattr(convert, "convert", converted)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook
    assert convert.main(["--model", "m", "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [convert.INTERRUPTED]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook) == handlers


def _start_conversion(model_dir: str, out) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "granite_jax.convert", "--model", model_dir, "--out", str(out), "--quiet"]
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONFAULTHANDLER": "1"}  # SIGABRT: every thread's traceback
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _reached(moment: str, proc: subprocess.Popen, model_dir: str, partial: str) -> bool:
    if moment == "load":  # the safetensors file is mapped while it is read
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/maps") as f:
            return os.path.join(os.path.realpath(model_dir), "model.safetensors") in f.read()
        return False
    names = set(os.listdir(partial)) if os.path.isdir(partial) else set()
    if moment == "save":  # orbax's own temporary directory for state/
        return any(n.startswith(checkpoint.STATE_DIR) for n in names)
    side_files = {n for n in os.listdir(model_dir) if not n.endswith(".safetensors")}
    return side_files <= names  # copied, the last step before the marker and the rename


def _wait_for(moment: str, proc: subprocess.Popen, model_dir: str, out) -> str:
    """Poll until the conversion `proc` reaches `moment`; returns its partial directory.

    As soon as the partial directory appears, the test puts a FIFO where the completion marker goes and never opens
    it: writing the marker blocks, so the conversion cannot get to the rename before the test's signal."""
    partial, deadline = checkpoint.partial_dir(out, proc.pid), time.monotonic() + 120
    gate = os.path.join(partial, checkpoint.MARKER)
    while not _reached(moment, proc, model_dir, partial):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the conversion did not reach the {moment} (exit status {proc.wait()}): {proc.stderr.read()}")
        if os.path.isdir(partial) and not os.path.lexists(gate):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile: the conversion failed
                os.mkfifo(gate)
        time.sleep(0.001)
    return partial


def _ended(proc: subprocess.Popen, gate: str) -> str:
    """The stderr of `proc` once it has ended after a signal.

    The kernel may deliver a process's signal to a thread other than the main one (one that is running, when the main
    thread has another signal pending). Python then runs the handler at the main thread's next bytecode, which never
    comes while it is blocked on the test's FIFO gate (a real conversion never blocks there): the gate is opened if the
    conversion has not ended. One that still does not end is aborted, and the failure shows each thread's traceback."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.communicate(timeout=20)[1]
    with contextlib.suppress(FileNotFoundError, OSError):
        os.close(os.open(gate, os.O_RDONLY | os.O_NONBLOCK))  # the writer's open returns; its write then fails
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.communicate(timeout=40)[1]
    proc.send_signal(signal.SIGABRT)
    pytest.fail(f"the conversion did not end after the signal: {proc.communicate()[1][-6000:]}")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux: FIFOs and /proc/PID/maps")
@pytest.mark.parametrize(
    ("moment", "signum"),
    [("load", signal.SIGTERM), ("save", signal.SIGINT), ("publish", signal.SIGTERM)],
    ids=lambda v: getattr(v, "name", v),
)
def test_an_interrupt_leaves_nothing_and_says_so_in_one_line(tiny_checkpoint, tmp_path, moment, signum):
    proc = _start_conversion(tiny_checkpoint, tmp_path / "out")
    try:
        partial = _wait_for(moment, proc, tiny_checkpoint, tmp_path / "out")
        proc.send_signal(signum)
        err = _ended(proc, os.path.join(partial, checkpoint.MARKER))
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip().splitlines() == [convert.INTERRUPTED], err[-3000:]
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux: FIFOs")
def test_a_partial_left_by_a_killed_conversion_is_removed_by_the_next(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    proc = _start_conversion(tiny_checkpoint, out)
    try:
        partial = _wait_for("save", proc, tiny_checkpoint, out)
    finally:
        proc.kill()  # SIGKILL: no handler runs
        proc.communicate()
    assert os.path.isfile(os.path.join(partial, checkpoint.PARTIAL_OWNER))
    cmd = [sys.executable, "-m", "granite_jax.convert", "--model", tiny_checkpoint, "--out", str(out), "--quiet"]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.strip().splitlines() == [
        f"granite_jax.convert: removed a partial conversion left by an interrupted run: {partial}"
    ]
    assert os.listdir(tmp_path) == ["out"] and checkpoint.read_marker(out)["num_params"] > 0


@pytest.mark.parametrize("writer", ["running", "unknown"])
def test_a_partial_conversion_that_may_be_in_progress_is_refused_with_the_command(tiny_checkpoint, tmp_path, writer):
    partial = checkpoint.partial_dir(tmp_path / "out", 1)
    os.mkdir(partial)
    if writer == "running":  # pid 1, init: always running
        owner = {"pid": 1, "host": socket.gethostname()}
        with open(os.path.join(partial, checkpoint.PARTIAL_OWNER), "w") as f:
            json.dump(owner, f)
    with pytest.raises(CheckpointError) as info:
        convert.convert(tiny_checkpoint, tmp_path / "out")
    assert str(info.value).endswith(f"remove it: rm -rf {partial}") and len(str(info.value).splitlines()) == 1
    assert os.listdir(tmp_path) == [os.path.basename(partial)]


@pytest.mark.parametrize("where", ["no_marker", "killed_partial"])
def test_incomplete_checkpoint_refused(orbax_checkpoint, tmp_path, where):
    # A process killed mid-save leaves a hidden `.NAME.partial-*` sibling without the marker, written last.
    target = tmp_path / ("ckpt" if where == "no_marker" else ".ckpt.partial-abc123")
    shutil.copytree(orbax_checkpoint, target)
    os.remove(target / checkpoint.MARKER)
    with pytest.raises(CheckpointError, match="incomplete orbax checkpoint"):
        load_model(target)


def test_checkpoint_of_an_older_format_version_refused(orbax_checkpoint, tmp_path):
    # Version 1 stored linear weights (in, out); reading it as version 2 would silently transpose every projection.
    target = tmp_path / "old"
    shutil.copytree(orbax_checkpoint, target)
    marker = json.loads((target / checkpoint.MARKER).read_text())
    (target / checkpoint.MARKER).write_text(json.dumps({**marker, "version": 1}))
    with pytest.raises(CheckpointError, match="version 1, this granite-jax reads version 2; convert .* again"):
        load_model(target)


def test_converting_an_orbax_checkpoint_refused(orbax_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="already a granite-jax orbax checkpoint"):
        convert.convert(orbax_checkpoint, tmp_path / "again")


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "granite_jax.convert", "--model", str(tmp_path / "missing"), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"granite_jax.convert: error: {tmp_path / 'missing'}: model directory not found"
    ]


def test_export_to_hf_safetensors_round_trip(orbax_checkpoint, tmp_path):
    model = load_model(orbax_checkpoint)
    export_safetensors(model, tmp_path / "hf")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    for a, b in zip(_leaves(model), _leaves(load_model(tmp_path / "hf")), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_corrupt_orbax_state_is_one_line_exit_2(orbax_checkpoint, tmp_path):
    # One failed read makes orbax abandon the others, whose tracebacks Python would print around the error line.
    target = tmp_path / "corrupt"
    shutil.copytree(orbax_checkpoint, target)
    largest = max(
        (p for p in (target / checkpoint.STATE_DIR).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data = bytearray(largest.read_bytes())
    data[len(data) // 4 :] = bytes(len(data) - len(data) // 4)
    largest.write_bytes(bytes(data))
    cmd = [sys.executable, "-m", "granite_jax.generate", "--model", str(target), "--prompt", "hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot restore the orbax state" in lines[0], proc.stderr[-3000:]


def test_orbax_restore_failure_is_one_clear_error(orbax_checkpoint, monkeypatch, process_hooks):
    # The message orbax raises, trimmed to its first line without the TensorStore spec (as the CLIs print it).
    class Failing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def restore(self, *args):
            raise ValueError(
                "Encountered error while reading array index: (slice(0, 4, 1),). See full TensorStore "
                "details: <bound method pybind11_detail_function_record.spec of TensorStore({\n})>."
            )

    monkeypatch.setattr(checkpoint, "_checkpointer", Failing)
    with pytest.raises(CheckpointError, match="cannot restore the orbax state") as info:
        load_model(orbax_checkpoint)
    assert "TensorStore details" not in str(info.value) and len(str(info.value).splitlines()) == 1


@pytest.fixture
def process_hooks(monkeypatch):
    """sys.unraisablehook and the asyncio logger's filters, put back after the test; yields what the hook saw."""
    gc.collect()  # earlier garbage, not this test's
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u))
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
    return seen


def _asyncio_record(error: BaseException) -> logging.LogRecord:
    record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", (), None)
    record.exc_info = (type(error), error, error.__traceback__)
    return record


def _raised_in(filename: str) -> BaseException:
    code = compile("def fail():\n    raise ValueError('read failed')\n", filename, "exec")
    scope = {}
    exec(code, scope)
    try:
        scope["fail"]()
    except ValueError as e:
        return e


def test_abandoned_read_filters_are_narrow(process_hooks):
    orbax_file = os.path.join(checkpoint._orbax_dir(), "checkpoint", "somewhere.py")
    with pytest.raises(RuntimeError), checkpoint._abandoned_reads_ignored():
        hook = sys.unraisablehook
        with checkpoint._abandoned_reads_ignored():  # nested or repeated: installed once
            assert sys.unraisablehook is hook
        raise RuntimeError("the restore failed")
    assert sys.unraisablehook is hook  # kept after a failure: the abandoned reads report later

    class Finaliser:
        def __del__(self):
            raise RuntimeError("Event loop is closed")  # the same message, not from asyncio's call_soon_threadsafe

    Finaliser()
    assert [repr(u.exc_value) for u in process_hooks] == ["RuntimeError('Event loop is closed')"]
    coroutine = types.SimpleNamespace(cr_code=types.SimpleNamespace(co_filename=orbax_file))
    assert checkpoint._is_abandoned_read(types.SimpleNamespace(object=coroutine, exc_value=None, exc_traceback=None))
    coroutine.cr_code.co_filename = __file__
    assert not checkpoint._is_abandoned_read(
        types.SimpleNamespace(object=coroutine, exc_value=None, exc_traceback=None)
    )

    asyncio_log = logging.getLogger("asyncio")
    assert not asyncio_log.filter(_asyncio_record(_raised_in(orbax_file)))  # dropped
    assert asyncio_log.filter(_asyncio_record(_raised_in(__file__)))  # kept: not raised in orbax
    looped = _raised_in(__file__)
    looped.__cause__ = looped
    assert asyncio_log.filter(_asyncio_record(looped))


def test_a_successful_restore_leaves_the_hooks_as_they_were(orbax_checkpoint, process_hooks):
    hook = sys.unraisablehook
    load_model(orbax_checkpoint)
    assert sys.unraisablehook is hook and logging.getLogger("asyncio").filters == []
