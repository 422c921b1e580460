"""The whole GPU check in one run, within --budget-seconds of device time: correctness first, then the timings the
issues ask for, each beside its floor and, where one runs, transformers measured in the same run, and where the
steps' time goes.

    python benchmarks/gpu_check.py --out-dir benchmarks/results              # all parts, 360 s
    python benchmarks/gpu_check.py --parts tokens,parity --budget-seconds 120

Parts, in order, each a process of its own (the GPU's memory is free again between them) with a share of the budget
in proportion to its weight; a part that fails or runs out of time is recorded and the rest go on:

- tokens: `gpu_generate.py`, the Pallas SSD's greedy tokens against the XLA SSD's (float32 must agree).
- parity: `granite_jax.compare`, float32, four of h-tiny's layers, transformers on the GPU: per-layer error and
  greedy agreement.
- speed: `granite_jax.compare`, bfloat16, Pallas: h-tiny's prefill of 512 tokens at batch 1 and 8, and decode steps at
  batch 1, 8 and 64, beside transformers'; then the prefill of 8,192 tokens at batch 1 and 8. Each step's time is
  also given over its floor (`gpu_report.floor`: the bytes and FLOPs it must move at 4.8 TB/s and 989 TFLOP/s).
- ssd: `gpu_ssd.py`, the SSD at 2k, 8k and 32k tokens and one Mamba layer, against the XLA SSD at both precisions.
- profile: a prefill of 8,192 tokens and 64 decode steps of h-tiny under `jax.profiler`, each trace's device time
  split into GEMM, SSD, attention, MoE routing, norm/elementwise, copies and idle gaps (`kernel_category`).
- train: `granite_jax.train` fine-tunes h-350m's architecture on the standard library for 30 steps: tokens/s and
  MFU (needs ml_collections: `pip install --no-deps ml_collections-*.whl`).
- serve: `serve_load.py` on 8 of h-tiny's layers at concurrency 1, 8, 32 and 64.

Writes gpu_check-<date>-<device>.json (every part's own results inside) and a PNG of each timing over its floor
into --out-dir. Exit status: 1 if a correctness part (tokens, parity) failed or did not finish, else 0; 2 for bad
arguments or without a GPU (unless --smoke, which runs every part at tiny sizes on the CPU to check the script).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # runs from a plain checkout
SHAPE = "granite-4.0-h-tiny"
PARTS = {"tokens": 1.0, "parity": 1.0, "speed": 3.0, "ssd": 1.5, "profile": 1.0, "train": 1.0, "serve": 1.5}
CORRECTNESS = ("tokens", "parity")
# A kernel's name (XLA's fusion, a cuBLAS/cuDNN or Triton kernel: Pallas kernels carry their function's name) and
# its event's details (the HLO op and the JAX operation it came from) to a category, first match wins; the rest is
# norm/elementwise.
CATEGORIES = (
    ("copies", r"^(memcpy|memset|copy)"),
    ("SSD", r"ssd|mamba|chunk_state|state_pass|chunk_scan|selective"),
    ("attention", r"attention|flash|fmha|cudnn|softmax"),
    ("MoE routing", r"top_?k|route|sort|scatter|bincount|cumsum"),
    ("GEMM", r"gemm|cublas|cutlass|nvjet|xmma|matmul|dot|ragged|experts_"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from granite_jax.cli import ArgumentParser, positive_float

    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--budget-seconds", type=positive_float, default=360.0, help="all parts together")
    p.add_argument("--out-dir", default="benchmarks/results", help="where the JSON and PNG go")
    p.add_argument("--smoke", action="store_true", help="every part at tiny sizes on CPU (checks the script)")
    p.add_argument("--profile-part", action="store_true", help=argparse.SUPPRESS)  # the profile part's own process
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if unknown := [s for s in args.parts if s not in PARTS]:
        p.fail(f"--parts: unknown part {unknown[0]!r}; expected some of {', '.join(PARTS)}")
    if not args.parts:
        p.fail("--parts: none given")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        p.fail(f"--out-dir {args.out_dir}: not a directory")
    return args


# ---------------------------------------------------------------------------------------------- the parts


def part_commands(part: str, work: str, smoke: bool) -> list[tuple[str, list[str], str]]:
    """(label, command, its result file) of each process `part` runs; results go under `work`."""
    py, bench = sys.executable, os.path.join(ROOT, "benchmarks")
    tiny = ["--config", "tiny", "--torch-device", "cpu"] if smoke else ["--config", SHAPE, "--torch-device", "cuda"]
    compare = [py, "-m", "granite_jax.compare", "--quiet", "--seed", "0", *tiny]

    def out(name: str) -> str:
        return os.path.join(work, name)

    if part == "tokens":
        return [("tokens", [py, f"{bench}/gpu_generate.py", "--out", out("tokens.json")] + ["--smoke"] * smoke,
                 out("tokens.json"))]  # fmt: skip
    if part == "parity":
        args = (
            compare + ["--dtype", "float32", "--no-speed", "--out", out("parity")] + ["--num-layers", "4"] * (not smoke)
        )
        return [("parity", args, out("parity/compare.json"))]
    if part == "speed":
        ssd = "xla" if smoke else "pallas"  # the kernels need a GPU
        fast = [
            "--dtype",
            "bfloat16",
            "--ssd-impl",
            ssd,
            "--repeats",
            "1",
            "--error-len",
            "64",
            "--agreement-tokens",
            "2",
        ]
        short = ["--prompt-len", "32" if smoke else "512", "--batch-sizes", "1,2" if smoke else "1,8,64"]
        long = ["--prompt-len", "64" if smoke else "8192", "--batch-sizes", "1,2" if smoke else "1,8"]
        return [
            ("speed-512", compare + fast + short + ["--new-tokens", "17", "--out", out("speed-512")],
             out("speed-512/compare.json")),
            ("speed-8192", compare + fast + long + ["--new-tokens", "5", "--out", out("speed-8192")],
             out("speed-8192/compare.json")),
        ]  # fmt: skip
    if part == "ssd":
        sizes = ["--smoke", "--no-layer"] if smoke else ["--lengths", "2048,8192,32768"]
        return [("ssd", [py, f"{bench}/gpu_ssd.py", "--no-split", *sizes, "--out", out("ssd.json")], out("ssd.json"))]
    if part == "profile":
        return [("profile", [py, os.path.abspath(__file__), "--profile-part", "--out", out("profile.json")]
                 + ["--smoke"] * smoke, out("profile.json"))]  # fmt: skip
    if part == "train":
        preset = [] if smoke else ["--config.model.preset=granite-4.0-h-350m", "--config.data.train=stdlib"]
        config = "tiny.py" if smoke else "finetune.py"
        steps = "4" if smoke else "30"
        return [("train", [py, "-m", "granite_jax.train", "--config", os.path.join(ROOT, "configs", "train", config),
                           *preset, f"--config.steps={steps}", "--config.eval.every=0",
                           "--config.eval.headers=0", f"--config.output_dir={out('train')}"],
                 out("train/summary.json"))]  # fmt: skip
    shape = ["--concurrency", "1,2", "--seconds", "2", "--max-tokens", "8", "--max-batch", "2"] if smoke else [
        "--shape", SHAPE, "--layers", "8", "--dtype", "bfloat16", "--seconds", "10"]  # fmt: skip
    return [("serve", [py, f"{bench}/serve_load.py", *shape, "--out", out("serve.json")], out("serve.json"))]


def run_part(label: str, command: list[str], result: str, seconds: float) -> dict[str, Any]:
    """Run one process for at most `seconds`; its status, time, the tail of its output and its result file."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
        status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        tail = (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:
        status, tail = f"timed out after {seconds:.0f} s", _text(e.stdout)[-1000:] + _text(e.stderr)[-1000:]
    row: dict[str, Any] = dict(part=label, status=status, seconds=time.perf_counter() - start, command=command)
    if status != "ok":
        row["output_tail"] = tail
    if os.path.isfile(result):
        with open(result) as f:
            row["result"] = json.load(f)
    return row


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


# ---------------------------------------------------------------------------------------------- the floors


def speed_rows(compare: dict[str, Any], floor: Callable[..., dict[str, float]]) -> list[dict[str, Any]]:
    """compare.json's speed rows as one line per step: granite-jax's time, transformers', and the floor's."""
    rows = []
    for s in compare.get("speed", []):
        b, t, n = s["batch"], s["prompt_len"], s["new_tokens"]
        ours, theirs = s["jax"], s["hf"]
        prefill = floor("prefill", b, t)["seconds"]
        decode = floor("decode", b, 1, cache_len=t + n)["seconds"]
        for step, key, steps, f in (("prefill", "prefill_s", 1, prefill), ("decode", "decode_s", n - 1, decode)):
            ours_s, theirs_s = ours[key] / steps, theirs[key] / steps
            rows.append(dict(step=f"{step} b{b} T{t}", seconds=ours_s, transformers_seconds=theirs_s,
                             floor_seconds=f, over_floor=ours_s / f, share_of_floor=f / ours_s,
                             vs_transformers=theirs_s / ours_s))  # fmt: skip
    return rows


def shape_config(smoke: bool):
    """The architecture the parts run: h-tiny's, or with --smoke the tests' tiny hybrid."""
    from granite_jax.experiments.common import model_config

    return model_config("tiny" if smoke else SHAPE)


def model_floor(cfg, dtype: str) -> Callable[..., dict[str, float]]:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gpu_report import floor

    return lambda kind, batch, tokens, cache_len=0: floor(cfg, kind, batch, tokens, dtype=dtype, cache_len=cache_len)


# ---------------------------------------------------------------------------------------------- the profile


def kernel_category(name: str, details: str = "") -> str:
    """A device kernel's category by its name and details (`CATEGORIES`), else norm/elementwise."""
    text = f"{name} {details}".lower()
    return next((label for label, pattern in CATEGORIES if re.search(pattern, text)), "norm/elementwise")


def device_time_split(trace: dict[str, Any]) -> dict[str, float]:
    """Seconds of a Chrome/Perfetto trace's GPU kernels by category, and the idle gaps: the span from the first kernel
    to the last not covered by any kernel. Kernels are the complete events on the device's stream threads."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and
             e.get("name") in ("process_name", "thread_name")}  # fmt: skip
    device = {pid for (pid, tid), n in names.items() if tid is None and re.search(r"/device:GPU", n)}
    streams = {key for key, n in names.items() if key[0] in device and key[1] is not None and "stream" in n.lower()}
    kernels = [e for e in events if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams]
    split: dict[str, float] = {}
    for e in kernels:
        category = kernel_category(e["name"], " ".join(str(v) for v in e.get("args", {}).values()))
        split[category] = split.get(category, 0.0) + e["dur"] / 1e6
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, None
    for a, b in intervals:  # the union of the kernels' intervals
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    split["idle gaps"] = max(span - busy, 0.0) / 1e6
    split["kernels"] = len(kernels)
    return split


def profile_part(out: str, smoke: bool) -> int:
    """The profile part's own process: h-tiny (smoke: a tiny hybrid) with random weights, a prefill and decode steps
    traced apart, each trace's device time split."""
    import jax
    import jax.numpy as jnp

    from granite_jax.experiments.common import random_model
    from granite_jax.generation import Generator
    from granite_jax.ops import Runtime

    cfg = shape_config(smoke)
    dtype = jnp.float32 if smoke else jnp.bfloat16
    model = random_model(cfg, dtype=dtype, runtime=Runtime(ssd="xla" if smoke else "pallas"))
    generator = Generator(model=model, tokenizer=None, max_cache_len=None)
    runs = {"prefill-8192": (64 if smoke else 8192, 1), "decode-b1": (16, 8 if smoke else 65)}
    result: dict[str, Any] = dict(device=jax.devices()[0].device_kind, shape="tiny" if smoke else SHAPE, traces={})
    for name, (prompt_len, new_tokens) in runs.items():
        prompt = [[(7 * i) % cfg.vocab_size for i in range(prompt_len)]]
        generator.generate(prompt, max_new_tokens=new_tokens, stop_token_ids=())  # compiled before the trace
        with tempfile.TemporaryDirectory() as logs:
            with jax.profiler.trace(logs, create_perfetto_trace=True):
                generator.generate(prompt, max_new_tokens=new_tokens, stop_token_ids=())
            path = next(os.path.join(d, f) for d, _, fs in os.walk(logs) for f in fs if f == "perfetto_trace.json.gz")
            with gzip.open(path) as f:
                result["traces"][name] = device_time_split(json.load(f))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


# ---------------------------------------------------------------------------------------------- the report


def summarize(rows: list[dict[str, Any]], smoke: bool) -> dict[str, Any]:
    """The figures the issues ask for, pulled out of the parts' results."""
    floor = model_floor(shape_config(smoke), "float32" if smoke else "bfloat16")
    out: dict[str, Any] = dict(steps=[], correctness={})
    for row in rows:
        r, part = row.get("result"), row["part"]
        if part in CORRECTNESS:
            out["correctness"][part] = row["status"] == "ok" and bool(r) and _correct(part, r)
        if r is None:
            continue
        if part.startswith("speed"):
            out["steps"] += speed_rows(r, floor)
        elif part == "profile":
            out["profile"] = r["traces"]
        elif part == "train":
            out["train"] = {k: r.get(k) for k in ("train_tokens_per_s", "model_tflops_per_s", "parameters")}
            out["train"]["mfu"] = (r.get("model_tflops_per_s") or 0.0) / 989.0
        elif part == "ssd":
            out["ssd"] = r.get("speedups", [])
    return out


def _correct(part: str, result: dict[str, Any]) -> bool:
    if part == "tokens":
        return bool(result.get("ok"))
    greedy = result.get("greedy", {})
    return greedy.get("agreed") == greedy.get("total") and bool(greedy.get("total"))


def plot(summary: dict[str, Any], path: str) -> None:
    """Each timed step's share of its floor (1 is the hardware's limit), granite-jax beside transformers."""
    from granite_jax.experiments.common import matplotlib_pyplot

    plt = matplotlib_pyplot()
    steps = summary["steps"]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(steps) + 1.5))
    y = range(len(steps))
    ax.barh([i + 0.2 for i in y], [s["share_of_floor"] for s in steps], height=0.4, label="granite-jax")
    ax.barh([i - 0.2 for i in y], [s["floor_seconds"] / s["transformers_seconds"] for s in steps], height=0.4,
            label="transformers")  # fmt: skip
    ax.set_yticks(list(y), [s["step"] for s in steps])
    ax.set_xscale("log")
    ax.set_xlabel("share of the step's floor (floor time / measured time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile_part:
        return profile_part(args.out, args.smoke)
    import jax

    from granite_jax.experiments.common import environment, write_json

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        print("gpu_check.py: error: no GPU; --smoke checks the script on the CPU", file=sys.stderr)
        return 2
    try:  # before the device time is spent: the results must have somewhere to go
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        print(f"gpu_check.py: error: --out-dir {args.out_dir}: {e.strerror}", file=sys.stderr)
        return 2
    total = sum(PARTS[p] for p in args.parts)
    start, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as work:
        for part in args.parts:
            commands = part_commands(part, work, args.smoke)
            for label, command, result in commands:
                share = args.budget_seconds * PARTS[part] / total / len(commands)
                print(f"[{time.perf_counter() - start:5.0f}s] {label} (at most {share:.0f} s)", file=sys.stderr)
                rows.append(run_part(label, command, result, share))
                print(f"        {rows[-1]['status']} in {rows[-1]['seconds']:.0f} s", file=sys.stderr)
    summary = summarize(rows, args.smoke)
    name = f"gpu_check-{time.strftime('%Y-%m-%d')}-{'cpu-smoke' if args.smoke else 'h200'}"
    path = os.path.join(args.out_dir, name + ".json")
    command = "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json(path, dict(command=command, summary=summary, parts=rows, environment=environment()))
    if summary["steps"]:
        plot(summary, os.path.join(args.out_dir, name + ".png"))
    print(report(summary))
    print(f"wrote {path}")
    return 0 if all(summary["correctness"].get(p, True) for p in args.parts if p in CORRECTNESS) else 1


def report(summary: dict[str, Any]) -> str:
    lines = ["| step | granite-jax ms | share of floor | transformers ms | vs transformers |", "|---|---|---|---|---|"]
    for s in summary["steps"]:
        lines.append(f"| {s['step']} | {s['seconds'] * 1e3:.3f} | {s['share_of_floor']:.1%} | "
                     f"{s['transformers_seconds'] * 1e3:.3f} | {s['vs_transformers']:.2f}x |")  # fmt: skip
    for name, split in summary.get("profile", {}).items():
        total = sum(v for k, v in split.items() if k != "kernels") or 1.0
        parts = ", ".join(f"{k} {v / total:.0%}" for k, v in split.items() if k != "kernels")
        lines.append(f"\n{name}: {split['kernels']} kernels; {parts}")
    if "train" in summary:
        t = summary["train"]
        lines.append(f"\ntrain: {t['train_tokens_per_s'] or 0:.0f} tokens/s, MFU {t['mfu']:.1%}")
    lines.append("\ncorrectness: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in
                                               summary["correctness"].items()))  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
