"""The command line for generating text: `python -m granite_jax.generate`.

    python -m granite_jax.generate --model DIR --prompt "Hello"          # streams the reply
    python -m granite_jax.generate --model DIR --prompt a --prompt b --json

The work is the `Generator`'s (`granite_jax.generation`); this module reads flags and prompts and prints results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

import numpy as np

from granite_jax import cli, sharding
from granite_jax.checkpoint import AUTO, DTYPES, FLOAT8_NAME, NO_MODEL_MESSAGE, WEIGHT_DTYPES, default_model_dir
from granite_jax.errors import GenerationError
from granite_jax.generation import Generator, SamplingConfig, Timing
from granite_jax.generation.generator import DECODE_CHUNK, StreamCallback
from granite_jax.ops import SSD_IMPLS, Runtime


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m granite_jax.generate",
        description="Generate text with a Granite 4.0 (GraniteMoeHybrid) checkpoint in JAX. "
        "Prompts come from --prompt, --prompt-file or, if neither is given, standard input (one prompt). "
        "Several prompts run as one left-padded batch; each stops on its own.",
        epilog="Examples:\n"
        '  python -m granite_jax.generate --model ckpt/granite-4.0-h-350m --prompt "The capital of France is"\n'
        '  python -m granite_jax.generate --model DIR --chat --system "Be brief." --prompt "Why is the sky blue?"\n'
        "  python -m granite_jax.generate --model DIR --prompt-file prompts.txt --temperature 0.7 --top-p 0.9 --json\n"
        "  echo 'Once upon a time' | python -m granite_jax.generate --model DIR --max-new-tokens 64\n\n"
        "Exit status: 0 on success, 2 on invalid input (bad flag value, missing model, prompt too long, ...).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = p.add_argument_group("model and prompts")
    io.add_argument(
        "--model",
        metavar="DIR",
        help="checkpoint directory: a Hugging Face GraniteMoeHybrid checkpoint (config.json, *.safetensors) with its "
        "tokenizer files, or its orbax conversion (python -m granite_jax.convert); the tokenizer is the one "
        "transformers' AutoTokenizer loads, from local files only. "
        "Default: the model shipped with granite-jax, a small Granite hybrid trained on Python's standard library "
        "(docs/training.md).",
    )
    io.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt; repeat for a batch")
    io.add_argument(
        "--prompt-file",
        action="append",
        default=[],
        metavar="FILE",
        help="a UTF-8 file with one prompt per line (blank lines are skipped); repeatable. "
        "For one multi-line prompt, pipe it on standard input instead.",
    )
    io.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the tokenizer's chat template (with the assistant turn opened)",
    )
    io.add_argument("--system", metavar="TEXT", help="system message for --chat")
    s = p.add_argument_group("sampling and stopping")
    s.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens to generate per prompt (128)")
    s.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default); > 0 samples softmax(l/T)"
    )
    s.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="with --temperature: sample among the K most likely tokens (0 = all)",
    )
    s.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="with --temperature: sample among the fewest most likely tokens with probability >= P, in (0, 1] "
        "(1 = all)",
    )
    s.add_argument(
        "--seed", type=int, default=0, help="with --temperature: random seed; the same seed gives the same output (0)"
    )
    s.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop a sequence at this string, matched in the decoded text without special tokens (repeatable; "
        "for a special token use --stop-token-id)",
    )
    s.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=None,
        metavar="ID",
        help="stop a sequence at this token id (repeatable); replaces the model's eos_token_id",
    )
    s.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at eos_token_id (always --max-new-tokens, or up to max_position_embeddings on a RoPE model)",
    )
    r = p.add_argument_group("runtime")
    r.add_argument(
        "--dtype",
        choices=[*DTYPES, FLOAT8_NAME],
        default="float32",
        help="arithmetic dtype, and the weights' unless --weight-dtype says otherwise (float32). float8: float8 "
        "weights (the matrices in e4m3 with one scale per output channel, the rest bfloat16) and bfloat16 "
        "arithmetic, short for --dtype bfloat16 --weight-dtype float8",
    )
    r.add_argument(
        "--weight-dtype",
        choices=[AUTO, *WEIGHT_DTYPES],
        default=AUTO,
        help="keep the weights in this dtype instead of --dtype. With --dtype float32, bfloat16 computes in float32 on "
        "the bfloat16 values: for a bfloat16 checkpoint (the released ones are) the float32 results at half the "
        "weight memory, and faster batch-1 decoding on CPUs. auto: bfloat16 when --dtype is float32, the "
        "checkpoint stores bfloat16 and the CPU kernels run, else --dtype (auto)",
    )
    r.add_argument(
        "--mesh",
        metavar="AXIS=N,...",
        help="run over a device mesh, e.g. data=2,model=4 (axes: data for the batch, model for heads and columns, "
        "expert for the routed experts; their sizes multiply to the device count). The weights load straight into "
        "their shards; the prompts must be a multiple of the data axis; the CPU kernels are off (docs/sharding.md)",
    )
    r.add_argument(
        "--ssd-impl",
        choices=SSD_IMPLS,
        default="xla",
        help="Mamba-2 SSD implementation (xla). pallas: Triton kernels for NVIDIA GPUs, 4.7x xla's SSD at 8k tokens "
        "with --dtype bfloat16 on an H200, but slower with float32 (docs/kernels.md)",
    )
    r.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        metavar="N",
        help="longest prompt segment processed at once; longer prompts are prefilled in segments that carry the "
        "conv, SSM and KV state, so prefill memory is bounded by the segment (512)",
    )
    r.add_argument(
        "--decode-chunk",
        type=cli.positive_int,
        default=DECODE_CHUNK,
        metavar="N",
        help="decode steps per compiled call, a loop on the device that ends once every prompt has produced a stop "
        f"token: the host's per-call work is paid once per N tokens, and streamed text arrives N tokens at a time "
        f"({DECODE_CHUNK}; 1: one call per token)",
    )
    r.add_argument(
        "--no-pack-weights",
        dest="pack_weights",
        action="store_false",
        default=None,
        help="do not copy the float32 or bfloat16 weights into the layout that CPU decode steps of 2-16 prompts stream "
        "(saves memory equal to the weights; those steps then run slower products: 1.5-2.9x in float32). Default: "
        "copy, before the first such step, when the CPU kernels are available and it fits in half the free memory",
    )
    r.add_argument(
        "--max-cache-len",
        type=int,
        default=None,
        metavar="N",
        help="fixed number of KV-cache slots (padded prompt + new tokens must fit); default: sized per request "
        "in buckets (>= 1024)",
    )
    o = p.add_argument_group("output")
    stream = o.add_mutually_exclusive_group()
    stream.add_argument(
        "--stream",
        dest="stream",
        action="store_true",
        default=None,
        help="print tokens as they are produced (default for a single prompt without --json)",
    )
    stream.add_argument("--no-stream", dest="stream", action="store_false", help="print each text when it is done")
    o.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document: texts, token ids, finish reasons and prefill/decode tokens per second",
    )
    o.add_argument("--quiet", action="store_true", help="no progress bar and no timing line on stderr")
    cli.add_cache_argument(r)
    return p


def _read_text(path: str | None) -> str:
    """A file's (or, for None, standard input's) text, strictly UTF-8."""
    where = "standard input" if path is None else path
    try:
        data = sys.stdin.buffer.read() if path is None else open(path, "rb").read()
    except OSError as e:
        raise GenerationError(f"{where}: cannot read ({e.strerror})") from None
    try:
        return data.decode("utf-8-sig")  # a byte order mark (Windows editors write one) is not part of the prompt
    except UnicodeDecodeError as e:
        raise GenerationError(f"{where}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _collect_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    for path in args.prompt_file:
        prompts += [line for line in _read_text(path).splitlines() if line.strip()]
    if not args.prompt and not args.prompt_file:
        if sys.stdin is None or sys.stdin.isatty():
            raise GenerationError("no prompt: pass --prompt TEXT, --prompt-file FILE or text on standard input")
        text = _read_text(None)
        prompts = [text[:-1] if text.endswith("\n") else text]
    if not prompts:
        raise GenerationError("no prompt: the prompt files are empty")
    empty = [i + 1 for i, prompt in enumerate(prompts) if not prompt]
    if empty:  # found before the model load (Generator checks again, for the Python API)
        raise GenerationError(f"prompt {empty[0]} is empty")
    return prompts


def _sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    stop_ids = () if args.ignore_eos else None
    if args.stop_token_id is not None:
        stop_ids = tuple(args.stop_token_id)
    return SamplingConfig(  # refuses sampling options that greedy decoding would ignore
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=stop_ids,
        stop_strings=tuple(args.stop),
    )


def _timing_line(t: Timing) -> str:
    return (
        f"prefill: {t.prompt_tokens} tokens in {t.prefill_s:.3f} s ({t.prefill_tokens_per_s:.1f} tok/s); "
        f"decode: {t.decode_tokens} tokens in {t.decode_s:.3f} s ({t.decode_tokens_per_s:.1f} tok/s); "
        f"compile: {t.compile_s:.1f} s"
    )


def _check_flag_combinations(args: argparse.Namespace) -> None:
    if args.stream and args.json:
        raise GenerationError("--stream and --json exclude each other: --json prints one JSON document at the end")
    if args.system is not None and not args.chat:
        raise GenerationError("--system needs --chat (the system prompt goes into the chat template)")
    if args.dtype == FLOAT8_NAME:  # float8 is a weight format: shorthand for bfloat16 arithmetic over float8 weights
        if args.weight_dtype not in (AUTO, FLOAT8_NAME):
            raise GenerationError(
                f"--dtype float8 means float8 weights; --weight-dtype {args.weight_dtype} contradicts it"
            )
        args.dtype, args.weight_dtype = "bfloat16", FLOAT8_NAME
    if args.ssd_impl == "pallas":
        import pallas_kernels

        try:
            pallas_kernels.check_available()
        except pallas_kernels.PallasUnavailableError as e:
            raise GenerationError(f"--ssd-impl: {e}") from None


def run_cli(args: argparse.Namespace) -> int:
    _check_flag_combinations(args)  # validate flags before the (slow) model load
    cli.use_compilation_cache(args.compilation_cache)
    sampling = _sampling_from_args(args)
    if args.model is None and default_model_dir() is None:
        raise GenerationError(NO_MODEL_MESSAGE)
    if args.model is not None and not os.path.isdir(args.model):
        raise GenerationError(f"{args.model}: model directory not found")
    prompts = _collect_prompts(args)
    mesh = None if args.mesh is None else sharding.parse_mesh(args.mesh)
    generator = Generator(
        args.model,
        mesh=mesh,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        runtime=Runtime(ssd=args.ssd_impl, pack_weights=args.pack_weights),
        prefill_chunk=args.prefill_chunk,
        decode_chunk=args.decode_chunk,
        max_cache_len=args.max_cache_len,
        progress=not args.quiet and not args.json,
    )
    stream = args.stream if args.stream is not None else (len(prompts) == 1 and not args.json)
    results = generator.generate(
        prompts,
        sampling,
        chat=args.chat,
        system=args.system,
        stream_callback=_printer(len(prompts)) if stream else None,
    )
    timing = results[0].timing
    if args.json:
        doc = {
            "model": args.model,
            "dtype": args.dtype,
            "weight_dtype": generator.weight_dtype,
            "sampling": dataclasses.asdict(sampling),
            "results": [r.as_dict() for r in results],
            "prefill_tokens_per_s": timing.prefill_tokens_per_s,
            "decode_tokens_per_s": timing.decode_tokens_per_s,
            "timing": timing.as_dict(),
        }
        print(json.dumps(_json_safe(doc), indent=2, ensure_ascii=False))
    elif stream:
        print(flush=True)
    elif len(results) == 1:
        print(cli.printable(results[0].text))
    else:
        for i, r in enumerate(results):
            print(f"=== prompt {i + 1} ({r.finish_reason}) ===\n{cli.printable(r.text)}")
    if not args.quiet and not args.json:
        print(_timing_line(timing), file=sys.stderr)
    return 0


def _printer(n_prompts: int) -> StreamCallback:
    """Streaming output: a single prompt's text as is; for a batch, one `[row] 'piece'` line per piece."""
    if n_prompts == 1:
        return lambda row, text: print(cli.printable(text), end="", flush=True)
    return lambda row, text: print(f"[{row + 1}] {text!r}", flush=True)


def _json_safe(x):
    """NaN/inf (e.g. decode tokens/s with a single new token) become null, as JSON has no NaN."""
    if isinstance(x, float):
        return x if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.guarded("granite_jax.generate", lambda: run_cli(args))


if __name__ == "__main__":
    sys.exit(main())
