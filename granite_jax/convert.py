"""Convert a Hugging Face GraniteMoeHybrid checkpoint into a granite-jax orbax checkpoint.

    python -m granite_jax.convert --model HF_DIR --out DIR [--dtype auto|float32|bfloat16|float16]

The weights are read with the safetensors importer (`checkpoint.load_model`), cast to `--dtype` and saved with orbax;
config.json, the tokenizer and the other small files of HF_DIR are copied beside them (see `checkpoint.py` for the
layout). DIR must not exist or be empty. Every command that takes a model directory accepts either kind.

SIGINT or SIGTERM at any moment ends the command with one line on stderr, exit status 130 and nothing written (see
`Interrupts`). A partial directory left beside DIR by a killed conversion is removed by the next conversion into DIR
if its writer has ended, and otherwise named with the command that removes it (`remove_abandoned_partials`).
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from granite_jax import cli
from granite_jax.checkpoint import (
    FLOAT8_NAME,
    WEIGHT_DTYPES,
    CheckpointError,
    check_writable,
    is_orbax_checkpoint,
    load_model,
    save_checkpoint,
    stored_dtype,
)
from granite_jax.checkpoint.orbax import MARKER, partial_dir, remove_abandoned_partials
from granite_jax.errors import InputError

INTERRUPTED = "granite_jax.convert: interrupted; nothing was written"


def convert(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "auto", progress=False) -> str:
    """HF checkpoint directory -> orbax checkpoint directory (parameters stored in `dtype`). Returns `out_dir`."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: model directory not found")
    if is_orbax_checkpoint(model_dir):
        raise CheckpointError(f"{model_dir}: is already a granite-jax orbax checkpoint; nothing to convert")
    check_writable(out_dir)  # before the (possibly long) load
    for path in remove_abandoned_partials(out_dir):
        print(f"granite_jax.convert: removed a partial conversion left by an interrupted run: {path}", file=sys.stderr)
    name = dtype
    if dtype == "auto":  # the dtype the safetensors store (their headers); float32 if they mix dtypes or hold float64
        stored = stored_dtype(model_dir)
        name = stored if stored in WEIGHT_DTYPES else "float32"
    if name not in WEIGHT_DTYPES:
        raise CheckpointError(f"dtype must be auto or one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    arithmetic = "bfloat16" if name == FLOAT8_NAME else name  # float8 is a storage format (checkpoint.dtypes)
    model = load_model(model_dir, dtype=arithmetic, weight_dtype=name, progress=progress)
    return save_checkpoint(model, out_dir, copy_from=model_dir, source=os.path.abspath(model_dir))


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m granite_jax.convert",
        description="Convert a Hugging Face GraniteMoeHybrid checkpoint (safetensors) into a granite-jax orbax "
        "checkpoint, with config.json and the tokenizer copied beside it. The result is written into a temporary "
        "sibling directory and moved into place only when complete.",
    )
    p.add_argument("--model", required=True, metavar="HF_DIR", help="Hugging Face checkpoint directory to read")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory; must not exist or be empty")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *WEIGHT_DTYPES),
        help="dtype to store the parameters in; 'auto' (default) keeps the dtype the checkpoint's tensors are "
        "stored in (float32 if they mix dtypes); 'float8' quantizes the matrices to float8 (e4m3) with one scale "
        "per output channel and keeps the rest in bfloat16",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    cli.add_cache_argument(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    before = _OutputBefore.of(args.out)
    with interrupts_raised() as interrupts:
        try:
            try:
                cli.use_compilation_cache(args.compilation_cache)
                out = convert(args.model, args.out, dtype=args.dtype, progress=not args.quiet)
                interrupts.check()
            finally:
                interrupts.raising = False  # a plain attribute store: no signal handler can run before it
        except BaseException as e:
            if interrupts.received is None and not isinstance(e, KeyboardInterrupt):
                if isinstance(e, InputError):
                    print(f"granite_jax.convert: error: {e}", file=sys.stderr)
                    return 2
                raise
            before.restore()
            print(INTERRUPTED, file=sys.stderr)
            return 130
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


class Interrupts:
    """SIGINT and SIGTERM as a KeyboardInterrupt in the main thread, and a record that one came, so none is lost.

    The first signal raises; later ones are only recorded, so that the cleanup the first one starts (removing the
    partial directory) is not cut short. Python drops an exception raised in a `__del__` or a garbage-collection
    callback ("Exception ignored in ..."): such a KeyboardInterrupt is raised again, outside it, and `check()` fails a
    conversion that went on regardless (a library that swallowed it), before it can be reported as written.
    """

    def __init__(self, previous_hook: Callable = sys.__unraisablehook__) -> None:
        self.received: int | None = None  # the first signal's number
        self.raising = True  # False once the conversion has ended: later signals are only recorded
        self._in_flight = False  # a KeyboardInterrupt was raised and has not been dropped
        self._reporting = False
        self._again: threading.Thread | None = None
        self._previous_hook = previous_hook

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        if self.raising and not self._in_flight:
            self._in_flight = True
            raise KeyboardInterrupt

    def unraisablehook(self, unraisable) -> None:
        """`sys.unraisablehook`: the KeyboardInterrupt `handle` raised where Python can only report it is raised again;
        anything else goes to the hook there was before.

        A thread raises it again once this hook has returned: a signal handler runs at the main thread's next call,
        which would still be in the hook if the hook simulated the signal itself (and Python would drop it again)."""
        if not (self._in_flight and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self._previous_hook(unraisable)
            return
        self._in_flight = False
        self._reporting = True
        self._again = threading.Thread(target=self._raise_again, daemon=True)
        self._again.start()
        self._reporting = False  # a plain attribute store, then the return: no signal handler runs in between

    def _raise_again(self) -> None:
        while self._reporting and self.raising:
            time.sleep(0.001)
        if self.raising:
            _thread.interrupt_main(self.received)

    def check(self) -> None:
        """Raise KeyboardInterrupt if a signal came, even one whose exception went astray."""
        if self.received is not None:
            self._in_flight = True
            raise KeyboardInterrupt

    def stop(self) -> None:
        """Only record signals from now on, and see that none is still to be raised again."""
        self.raising = False
        if self._again is not None:
            self._again.join()


@contextlib.contextmanager
def interrupts_raised() -> Iterator[Interrupts]:
    """Install `Interrupts` for SIGINT and SIGTERM (in the main thread: only it may), and put back what was there."""
    previous_hook = sys.unraisablehook
    interrupts = Interrupts(previous_hook)
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals}
    hook = sys.unraisablehook = interrupts.unraisablehook
    try:
        for s in signals:
            signal.signal(s, interrupts.handle)
        yield interrupts
    finally:
        interrupts.stop()
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        if sys.unraisablehook == hook:
            sys.unraisablehook = previous_hook


class _OutputBefore:
    """What the output path was before the conversion, to put back after an interrupt wherever it landed: before the
    partial directory was removed, or just after the rename."""

    def __init__(self, out: str, fresh: bool, existed: bool, created: list[str]) -> None:
        self.out = out
        self.fresh = fresh  # absent or an empty directory: anything in it later is the conversion's
        self.existed = existed  # an empty directory, which the rename replaces
        self.created = created  # the missing directories above it, which the save creates

    @classmethod
    def of(cls, out_dir: str) -> _OutputBefore:
        out = os.path.abspath(out_dir)
        try:
            existed = os.path.isdir(out) and not os.listdir(out)
        except OSError:  # unreadable: `check_writable` refuses it
            existed = False
        created, parent = [], os.path.dirname(out)
        while not os.path.exists(parent):
            created.append(parent)
            parent = os.path.dirname(parent)
        return cls(out, existed or not os.path.lexists(out), existed, created)

    def restore(self) -> None:
        shutil.rmtree(partial_dir(self.out), ignore_errors=True)  # ours by its pid; gone unless the cleanup was skipped
        if self.fresh and os.path.isfile(os.path.join(self.out, MARKER)):
            shutil.rmtree(self.out, ignore_errors=True)  # moved into place just before the interrupt
        if self.existed:
            os.makedirs(self.out, exist_ok=True)
        for d in self.created:  # deepest first; one that something else has filled meanwhile stays
            with contextlib.suppress(OSError):
                os.rmdir(d)


if __name__ == "__main__":
    status = main()
    for s in (signal.SIGINT, signal.SIGTERM):  # reported: a late signal must not change it while the process ends
        signal.signal(s, signal.SIG_IGN)
    sys.exit(status)
