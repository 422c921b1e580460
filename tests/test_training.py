"""granite_jax.training: gradients against float64 finite differences, the step, data order, n-gram baselines, and
the `python -m granite_jax.train` command (resumed after a kill, bad input)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from granite_jax.config import ModelConfig
from granite_jax.errors import InputError
from granite_jax.model import Granite
from granite_jax.ops import Runtime
from granite_jax.testing import TINY_CONFIG
from granite_jax.training import corpus, data, quality, step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_TRAIN = os.path.join(ROOT, "configs", "train", "tiny.py")


def tiny_model(dtype=jnp.float32, **runtime) -> Granite:
    """One Mamba and one attention layer, each with routed experts and the shared MLP: every kind of parameter, at
    half the tracing and compiling of the tests' four-layer model."""
    fields = dict(num_hidden_layers=2, layer_types=["mamba", "attention"], vocab_size=64, mamba_chunk_size=8)
    cfg = ModelConfig.from_hf_dict(TINY_CONFIG | fields)
    return Granite(cfg, dtype=dtype, param_dtype=dtype, runtime=Runtime(kernels=False, **runtime), rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------------------------------- gradients


@pytest.fixture(scope="module")
def float64():
    with jax.enable_x64(True):
        yield


def _mean_loss(graphdef, params, tokens):
    s, n = step.token_loss(graphdef, params, tokens[:, :-1], tokens[:, 1:], jnp.ones(tokens[:, 1:].shape))
    return s / n


@pytest.mark.parametrize("remat", [False, True])
def test_gradients_match_float64_finite_differences(float64, remat):
    """The model's gradient (Mamba mixers through the chunked "xla" SSD over several chunks, attention, routed
    experts, the shared MLP, the tied head) against central differences of the float64 loss along random
    directions: they agree to ~1e-8, where a wrong backward pass through any part would be off by far more."""
    graphdef, params = nnx.split(tiny_model(jnp.float64, remat=remat))
    tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, 64)  # 20 positions: 3 SSD chunks of 8
    loss = jax.jit(lambda p: _mean_loss(graphdef, p, tokens))
    grads = jax.jit(jax.grad(lambda p: _mean_loss(graphdef, p, tokens)))(params)
    assert all(g.dtype == jnp.float64 for g in jax.tree.leaves(grads))
    rng = np.random.default_rng(0)
    eps = 1e-6  # the weights' scale is 0.02: a unit direction curves the loss; rounding stays ~1e-10 over 2e-6
    for _ in range(3):
        direction = jax.tree.map(lambda p: rng.standard_normal(p.shape), params)
        moved = [loss(jax.tree.map(lambda p, d, s=s: p + s * eps * d, params, direction)) for s in (1, -1)]
        numeric = (moved[0] - moved[1]) / (2 * eps)
        analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
        assert abs(numeric - analytic) <= 1e-7 * abs(analytic), (numeric, analytic)


def test_gradients_of_every_parameter_group(float64):
    """Each parameter tensor's own directional derivative against finite differences: a part whose gradient were
    zeroed (a stop_gradient in the SSD, say) would pass a test along all parameters at once only by luck."""
    graphdef, params = nnx.split(tiny_model(jnp.float64))
    tokens = jax.random.randint(jax.random.key(2), (1, 17), 0, 64)
    loss = jax.jit(lambda p: _mean_loss(graphdef, p, tokens))
    grads = jax.jit(jax.grad(lambda p: _mean_loss(graphdef, p, tokens)))(params)
    flat, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(1)
    for i, (leaf, g) in enumerate(zip(flat, jax.tree.leaves(grads))):
        d = rng.standard_normal(leaf.shape)
        moved = [loss(jax.tree.unflatten(treedef, [*flat[:i], leaf + s * 1e-5 * d, *flat[i + 1 :]])) for s in (1, -1)]
        numeric, analytic = (moved[0] - moved[1]) / 2e-5, jnp.vdot(g, d)
        # Rounding of the float64 loss (~4) over a 2e-5 step: ~1e-11 of absolute error.
        assert abs(numeric - analytic) <= 1e-6 * abs(analytic) + 1e-9, (i, leaf.shape, numeric, analytic)


def test_a_few_steps_make_the_loss_fall():
    """AdamW on one repeated batch of text-like tokens: the loss falls well below its start, and gradient
    accumulation over two micro-batches makes the same update as the whole batch at once."""
    graphdef, params = nnx.split(tiny_model())
    lr = step.schedule(3e-2, 2, 30, 0.1)
    tx = step.optimizer(lr, weight_decay=0.1, b1=0.9, b2=0.95, clip_norm=1.0)
    train_step = step.make_train_step(graphdef, tx)
    tokens = np.tile(np.arange(17, dtype=np.int32) % 11, (4, 1))
    rows = data.Batch(tokens[:, :-1], tokens[:, 1:], np.ones((4, 16), np.float32))
    whole, halves = rows.reshaped(1, 4), rows.reshaped(2, 2)
    p1, _, m1 = train_step(jax.tree.map(jnp.copy, params), tx.init(params), whole.inputs, whole.targets, whole.mask)
    p2, _, m2 = train_step(jax.tree.map(jnp.copy, params), tx.init(params), halves.inputs, halves.targets, halves.mask)
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    opt_state, losses = tx.init(params), []
    for _ in range(30):
        params, opt_state, metrics = train_step(params, opt_state, whole.inputs, whole.targets, whole.mask)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses


def test_padding_carries_no_loss():
    """A masked target changes neither the loss nor the gradient, whatever token stands there."""
    graphdef, params = nnx.split(tiny_model())
    inputs = np.array([[5, 6, 7, 8, 9, 1, 0, 0]], np.int32)
    mask = np.array([[1, 1, 1, 1, 1, 0, 0, 0]], np.float32)
    loss = lambda p, targets: step.token_loss(graphdef, p, inputs, targets, mask)  # noqa: E731
    loss_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    results = []
    for filler in (0, 33):
        (s, n), g = loss_and_grad(params, np.array([[6, 7, 8, 9, 1, filler, filler, filler]], np.int32))
        results.append((float(s), float(n), jax.tree.leaves(g)))
    assert results[0][1] == results[1][1] == 5.0
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][2], results[1][2]):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------- data


def test_sampler_rows_are_a_function_of_seed_and_step():
    stream = np.arange(1000, dtype=np.int32)
    a, b = data.Sampler(stream, 16, 7, -1), data.Sampler(stream, 16, 7, -1)
    later = b.batch(40, 4)  # a fresh sampler jumping straight to step 40, as a resumed run does
    for s in range(41):
        got = a.batch(s, 4)
    np.testing.assert_array_equal(got.inputs, later.inputs)
    assert not np.array_equal(data.Sampler(stream, 16, 8, -1).batch(40, 4).inputs, later.inputs)
    rows = np.concatenate([a.batch(s, 4).inputs for s in range(a.rows_per_epoch // 4)])
    assert len({r[0] for r in rows}) == len(rows)  # an epoch visits each window once
    np.testing.assert_array_equal(later.targets[:, :-1], later.inputs[:, 1:])  # targets are the next tokens


def test_windows_pad_and_mask_the_tail():
    w = data.windows(np.arange(40, dtype=np.int32), 16, 0, -1)
    assert w.inputs.shape == (3, 16)
    assert w.mask.sum() == 39  # every token but the first is a target once
    assert (w.targets[w.mask == 0] == -1).all()


def test_split_is_disjoint_and_stable():
    files = corpus.stdlib_sources()
    assert any(f.endswith(os.path.join("json", "decoder.py")) for f in files)
    assert not any("site-packages" in f for f in files)
    train, held = corpus.split_files(files, 0.05)
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(files)
    assert 0.02 < len(held) / len(files) < 0.1
    assert corpus.split_files(files[::-1], 0.05)[1] == held[::-1]  # membership by name, not by position


def test_excluded_files_are_left_out(tmp_path):
    stdlib = corpus.matched_files("stdlib", "data.train", "test/*, */tests/*")
    names = {corpus.name(f) for f in stdlib}
    assert os.path.join("json", "decoder.py") in names and "unittest/case.py" in names
    assert not any(n.startswith("test/") or "/tests/" in n for n in names)
    (tmp_path / "tests").mkdir()
    for path in ("a.txt", "tests/b.txt"):
        (tmp_path / path).write_text("x")
    assert corpus.matched_files(f"{tmp_path}/**/*.txt", "data.train", "*/tests/*") == [str(tmp_path / "a.txt")]
    with pytest.raises(InputError, match=r"data.held_out: no files matched .* but data.exclude='\*.txt'"):
        corpus.matched_files(f"{tmp_path}/*.txt", "data.held_out", "*.txt")


def test_a_run_recorded_before_a_field_existed_resumes_with_its_default(tmp_path):
    from granite_jax.training import trainer
    from granite_jax.training.config import base_config

    config = base_config()
    trainer.check_resumable(config, str(tmp_path))
    recorded = json.loads((tmp_path / "config.json").read_text())
    del recorded["data"]["exclude"]  # as written before data.exclude was a field
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    trainer.check_resumable(config, str(tmp_path))
    config.data.exclude = "test/*"
    with pytest.raises(InputError, match=r"data.exclude: '' there, 'test/\*' here"):
        trainer.check_resumable(config, str(tmp_path))


def test_ngram_baselines_match_a_direct_count():
    """Against the formulas evaluated token by token in float64 from counted dictionaries."""
    rng = np.random.default_rng(0)
    train, held, V = rng.integers(0, 7, 300), rng.integers(0, 7, 50), 9
    got = quality.ngram_baselines(train, held, V)
    uni = {t: (list(train).count(t) + 1) / (len(train) + V) for t in range(V)}
    pairs: dict = {}
    for a, b in zip(train[:-1], train[1:]):
        pairs.setdefault(a, []).append(b)
    total_uni = total_bi = 0.0
    for a, b in zip(held[:-1], held[1:]):
        followers = pairs.get(a, [])
        c, t = len(followers), len(set(followers))
        lam = c / (c + t) if c else 0.0
        p_bi = lam * (followers.count(b) / c if c else 0.0) + (1 - lam) * uni[b]
        total_uni -= np.log(uni[b])
        total_bi -= np.log(p_bi)
    assert got["unigram"] == pytest.approx(total_uni / (len(held) - 1), rel=1e-12)
    assert got["bigram"] == pytest.approx(total_bi / (len(held) - 1), rel=1e-12)


def test_function_bodies_are_cut_at_the_first_dedent(tmp_path):
    header = "def add(a, b):"
    completion = "\n    return a + b\n\ndef other():\n    pass"  # the header's line ends, then the body
    assert quality.function_body(completion) == "\n    return a + b\n"
    assert quality.parses(header, quality.function_body(completion))
    assert quality.function_body("\n    x = 1\n    return (x +") == "\n    x = 1"  # unfinished last line dropped
    assert not quality.parses(header, quality.function_body("\n    return (a +\nprint()"))
    assert not quality.parses(header, "")
    # A body at a method's depth under a dedented header ends where its own indentation falls back.
    method = "\n        return self.x\n    def next(self):\n        pass"
    assert quality.function_body(method) == "\n        return self.x"
    assert quality.parses("def get(self):", quality.function_body(method))
    assert quality.function_body("\nreturn 1\n") == ""  # a first line at column 0 is no body
    assert quality.ends(completion) and not quality.ends("\n    x = 1\n    return (x +")  # cut by the token limit
    headers = quality.function_headers(
        corpus.matched_files(os.path.join(os.path.dirname(json.__file__), "*.py"), "x"), 3
    )
    assert len(set(headers)) == 3 and all(h.startswith("def ") and h.endswith(":") for h in headers)
    for name, source in [("a", "def f():\n    pass\n"), ("b", "def f():\n    pass\ndef g(x):\n    return x\n")]:
        (tmp_path / f"{name}.py").write_text(source)
    assert quality.function_headers([str(tmp_path / "a.py"), str(tmp_path / "b.py")], 5) == ["def f():", "def g(x):"]


# ---------------------------------------------------------------------------------------------- the command


def _train(out, *overrides, **kwargs):
    cmd = [sys.executable, "-m", "granite_jax.train", f"--config={TINY_TRAIN}", f"--config.output_dir={out}"]
    return subprocess.run([*cmd, *overrides], capture_output=True, text=True, cwd=ROOT, timeout=300, **kwargs)


@pytest.mark.slow(60)
def test_a_run_killed_at_any_moment_resumes_to_the_same_parameters(tmp_path):
    """The tiny run killed (SIGKILL) as soon as its first checkpoint exists, wherever it is, then started again:
    its exported weights are bitwise those of the run that was never stopped, and its metrics have one row per
    step. The uninterrupted run is also the determinism check: same seed, same bits."""
    steps = ["--config.steps=12", "--config.checkpoint.every=4", "--config.eval.every=6", "--config.log_every=2"]
    cmd = [sys.executable, "-m", "granite_jax.train", f"--config={TINY_TRAIN}", *steps]
    # The run left alone and the run to kill go side by side: two processes, half the wait.
    whole = subprocess.Popen([*cmd, f"--config.output_dir={tmp_path / 'whole'}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    proc = subprocess.Popen([*cmd, f"--config.output_dir={tmp_path / 'cut'}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    checkpoints = tmp_path / "cut" / "checkpoints"
    deadline = time.time() + 240
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "cut" / "model").exists()
    assert whole.wait(timeout=300) == 0, whole.stderr.read()[-2000:]
    resumed = _train(tmp_path / "cut", *steps)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    from safetensors.numpy import load_file

    a, b = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("whole", "cut"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    rows = [json.loads(line) for line in open(tmp_path / "cut" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == list(range(2, 13, 2))
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["held_out_loss"] < summary["baselines"]["unigram"] + 2  # trained, not diverged
    assert (tmp_path / "cut" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    from granite_jax.cli import load_config
    from granite_jax.training import trainer

    changed = load_config(TINY_TRAIN)
    fields = {"steps": 12, "checkpoint.every": 4, "eval.every": 6, "log_every": 2, "output_dir": str(tmp_path / "cut")}
    changed.update_from_flattened_dict(fields | {"optimizer.learning_rate": 0.1})
    with pytest.raises(InputError, match="optimizer.learning_rate"):
        trainer.check_resumable(changed, str(tmp_path / "cut"))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--config.data.train=/nonexistent/*.txt", "data.train: no files matched '/nonexistent/*.txt'"),
        ("--config.batch.size=3", "batch.size"),
        ("--config.data.seq_len=100000", "data.seq_len: 100000 is not a length the model takes"),
        ("--config.memory_gb=0.0001", "GiB available; not even one row fits"),
        ("--config.batch.micro=3", "batch.micro: 3 does not divide batch.rows=8"),
    ],
    ids=["no-files", "unknown-field", "seq-len", "memory", "micro"],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path, override, expected):
    result = _train(tmp_path / "run", override, "--config.steps=1")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_too_little_memory_says_which_micro_batch_fits(monkeypatch):
    """The advice names the largest micro-batch whose compiled step fits (its bytes as XLA reports them)."""
    from ml_collections import config_dict

    from granite_jax.training import trainer

    monkeypatch.setattr(trainer, "_compiled", lambda step, p, o, micro, config: micro)  # a "step" of micro GiB
    monkeypatch.setattr(trainer, "_step_bytes", lambda micro: micro * 2**30)
    config = config_dict.ConfigDict(dict(memory_gb=5.0, batch=dict(rows=16, micro=16), data=dict(seq_len=512)))
    with pytest.raises(
        InputError,
        match=r"batch.micro: a step of 16 rows of 512 tokens needs 16.00 GiB, 5.00 GiB "
        r"available; batch.micro=4 fits \(keep batch.rows=16",
    ):
        trainer.check_memory(None, None, None, config)
    config.memory_gb = 16.0
    assert trainer.check_memory(None, None, None, config) == 16  # the step for the configured batch
    tried = []
    bytes_of = lambda m: tried.append(m) or m  # noqa: E731
    assert trainer.largest_fitting_micro(bytes_of, 60, 60, 13) == 12  # divisors of 60 below 60: bisected
    assert len(tried) <= 5 and tried[0] == 1
    assert trainer.largest_fitting_micro(bytes_of, 4, 8, 0.5) is None


def test_shipped_training_configs_pass_the_command_check():
    from granite_jax.cli import file_problem, load_config
    from granite_jax.training.config import schema

    folder = os.path.join(ROOT, "configs", "train")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    assert {"default.py", "finetune.py", "tiny.py"} <= set(names)
    for name in names:
        path = os.path.join(folder, name)
        assert file_problem(path, load_config(path), "a training", "steps", schema) is None, name


def test_help_explains_and_no_config_is_one_line():
    cmd = [sys.executable, "-m", "granite_jax.train"]
    shown = subprocess.run([*cmd, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert shown.returncode == 0 and "--config.init_from" in shown.stdout and "docs/training.md" in shown.stdout
    missing = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "granite_jax.train: error: --config is required, e.g. --config configs/train/default.py"
    ]
