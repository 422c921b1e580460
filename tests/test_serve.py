"""`python -m granite_jax.serve` as users run it: a server process on localhost, driven by the `openai` package and a
raw httpx client. Greedy tokens match the Generator's alone, under 64 concurrent streams; bad requests get OpenAI's
error body; faults, disconnects, overload and SIGTERM are survived. The engine's own tests are in test_serving.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from granite_jax.generation import Generator

pytestmark = pytest.mark.slow(60)

SERVER_START_S = 300  # model load and the warm-up's compilations, on a cold compilation cache
FAULT_TOKEN = 7  # a prompt of only this token id makes the fault-injecting server's model raise (see FAULTY)
FAULTY = f"""
import sys
import numpy as np
from granite_jax.serving.engine import Engine

real = Engine.prefill

def prefill(self, cache, tokens):
    if tokens.shape[1] > 1 and (np.asarray(tokens) == {FAULT_TOKEN}).all():
        raise RuntimeError("injected fault")
    return real(self, cache, tokens)

Engine.prefill = prefill
from granite_jax.serve import main
sys.exit(main(sys.argv[1:]))
"""


class Server:
    """A server process started with `flags`, its URL read from its ready line."""

    def __init__(self, model_dir: str, *flags: str, code: str | None = None):
        entry = ["-c", code] if code else ["-m", "granite_jax.serve"]
        command = [sys.executable, *entry, "--model", model_dir, "--port", "0", "--prefill-chunk", "16", *flags]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + SERVER_START_S
        self.log: list[str] = []
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            self.log.append(line)
            if line.startswith("serving "):
                self.url = line.split(" on ")[1].strip()
                return
        self.process.kill()
        raise AssertionError(f"the server did not start: {''.join(self.log)}")

    def stop(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self.process.kill()

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health").json()


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint) -> str:
    return hf_checkpoint(tie_word_embeddings=False)  # an untied head: a random model's text depends on its state


@pytest.fixture(scope="module")
def generator(model_dir) -> Generator:
    return Generator(model_dir)


@pytest.fixture(scope="module")
def small_server(model_dir):
    """One slot, one place in the queue, and a model that fails on FAULT_TOKEN prompts (a server a test worker,
    shared by the tests that need no more than one slot)."""
    server = Server(model_dir, "--max-batch", "1", "--max-queue", "1", "--max-context", "512", code=FAULTY)
    yield server
    server.stop()


def alone(generator: Generator, prompt: str, n: int) -> str:
    return generator.generate(prompt, max_new_tokens=n)[0].text


def test_openai_client_completions_and_chat(small_server, generator, model_dir):
    server = small_server
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    name = os.path.basename(model_dir)
    assert [m.id for m in client.models.list().data] == [name]

    prompt = "The quick brown fox"
    reply = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    assert reply.choices[0].text == alone(generator, prompt, 12)
    assert reply.usage.prompt_tokens == len(generator.prompts.encode(prompt)[1][0])
    assert len(reply.choices[0].logprobs.token_logprobs) == reply.usage.completion_tokens
    chunks = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    chat = client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0)
    text = generator.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = generator.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat.choices[0].message.content == generator.generate(ids, max_new_tokens=10)[0].text
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content


def test_bad_requests_get_400_with_an_openai_error_body(small_server):
    server = small_server
    url = f"{server.url}/v1/completions"
    cases = {
        "malformed JSON": dict(content=b'{"prompt": "a", ', headers={"content-type": "application/json"}),
        "unknown field": dict(json={"prompt": "a", "frobnicate": 1}),
        "temperature out of range": dict(json={"prompt": "a", "temperature": 3}),
        "max_tokens 0": dict(json={"prompt": "a", "max_tokens": 0}),
        "several choices": dict(json={"prompt": "a", "n": 2}),
        "prompt longer than the context": dict(json={"prompt": "fox " * 600}),
        "prompt plus max_tokens past the context": dict(json={"prompt": "a", "max_tokens": 512}),
        "token id outside the vocabulary": dict(json={"prompt": [1, 10**6]}),
        "empty messages": dict(url=f"{server.url}/v1/chat/completions", json={"messages": []}),
    }
    for case, request in cases.items():
        response = httpx.post(request.pop("url", url), **request)
        assert response.status_code == 400, (case, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], case
    response = httpx.post(url, json={"prompt": "a", "model": "gpt-4"})
    assert response.status_code == 404 and "not served here" in response.json()["error"]["message"]


def test_64_concurrent_streams_get_the_tokens_each_gets_alone_and_sigterm_lets_one_finish(model_dir, generator):
    # 16 slots: the other 48 clients wait in the queue and join as rows free up.
    server = Server(model_dir, "--max-batch", "16", "--max-queue", "64", "--max-context", "96", "--prefill-budget", "8")
    prompts = [f"prompt {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(64)]

    async def stream(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        pieces = []
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(pieces)

    async def all_of_them() -> list[str]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    try:
        texts = asyncio.run(all_of_them())
        assert texts == [alone(generator, p, 8) for p in prompts]
        assert server.health()["active"] == 0
        sigterm_lets_in_flight_requests_finish(server)
    finally:
        server.process.kill()


def sigterm_lets_in_flight_requests_finish(server: Server) -> None:
    """SIGTERM while a request streams: the request runs to its end, then the server exits 0 (on the server above,
    not one of its own: a server start is the costliest part of these tests)."""
    body = {"prompt": "The quick brown fox", "max_tokens": 40, "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.process.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest if line.startswith("data: {")]
    assert finishes[-1] == "length"
    assert server.process.wait(60) == 0


def test_a_client_that_disconnects_mid_stream_frees_its_slot(small_server):
    server = small_server
    # 400 tokens: the request would still be running long after its client has gone.
    body = {"prompt": "The quick brown fox", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    cancelled = server.health().get("cancelled", 0)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 10
    while server.health()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    health = server.health()
    assert health["active"] == 0 and health["cancelled"] == cancelled + 1


def test_a_failing_request_gets_a_500_and_the_others_go_on(small_server, generator):
    url = f"{small_server.url}/v1/completions"
    bad = httpx.post(url, json={"prompt": [FAULT_TOKEN] * 4, "max_tokens": 4}, timeout=60)
    assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
    stream = httpx.post(url, json={"prompt": [FAULT_TOKEN] * 4, "max_tokens": 4, "stream": True}, timeout=60)
    assert stream.status_code == 500
    good = httpx.post(url, json={"prompt": "def forward(x):", "max_tokens": 6, "temperature": 0}, timeout=60)
    assert good.json()["choices"][0]["text"] == alone(generator, "def forward(x):", 6)


def test_requests_over_capacity_get_a_503_with_a_retry_hint(small_server):
    # Ten requests at once for one slot and one place in the queue: the first runs, the next waits, the rest are
    # turned away at once (a request takes tens of steps, the ten arrive together).
    body = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            url = f"{small_server.url}/v1/completions"
            return await asyncio.gather(*(client.post(url, json=body) for _ in range(10)))

    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert codes[0] == 200 and codes[-1] == 503 and set(codes) == {200, 503}, codes
    refused = next(r for r in responses if r.status_code == 503)
    assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["type"] == "server_overloaded"
    assert small_server.health()["waiting"] == 0


def test_bad_flags_and_a_taken_port_exit_2_with_one_line(call_main, model_dir):
    from granite_jax import serve

    code, err = call_main(serve.main, ["--model", model_dir, "--max-batch", "0"])
    assert code == 2 and "--max-batch" in err
    code, err = call_main(serve.main, ["--model", "/nonexistent"])
    assert code == 2 and "/nonexistent" in err
    taken = serve.listening_socket("127.0.0.1", 0)
    code, err = call_main(serve.main, ["--model", model_dir, "--port", str(taken.getsockname()[1])])
    taken.close()
    assert code == 2 and "cannot listen" in err and len(err.splitlines()) == 1
