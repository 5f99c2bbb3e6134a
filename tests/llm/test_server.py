"""``anygpu serve``'s application on a free loopback port (uvicorn in a thread, the tiny llama
on the cpu: the server does nothing device-specific), spoken to with OpenAI's own client:
chat and completions, streamed and not, usage, stop and seed; 16 concurrent clients get what
each gets alone; malformed requests get OpenAI's error objects; a client that hangs up frees
its slot; a full queue answers 429."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

MESSAGES = [{"role": "user", "content": "hello there!"}]
PROMPT = "hello there, "
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


class Running:
    def __init__(self, url: str, lm: Any, server: Any, expected: dict[str, Any]) -> None:
        self.url, self.lm, self.server, self.expected = url, lm, server, expected
        self.scheduler = server.scheduler

    def client(self, **kwargs: Any) -> Any:
        kwargs.setdefault("timeout", 120)  # a server that stopped answering fails, not hangs
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             **kwargs)


@pytest.fixture(scope="module")
def served(tiny: Any) -> Iterator[Running]:
    from anygpu import llm
    from anygpu.llm.server import build_app, warm_up

    lm = llm.load(tiny("llama")[0], device="cpu", max_seq_len=256, max_batch=4)
    lm.eos_token_ids = (2,)
    expected = {"chat": lm.chat(MESSAGES, max_new_tokens=8, ignore_eos=True),
                "completion": lm.generate(PROMPT, max_new_tokens=8, ignore_eos=True),
                "prompt_tokens": len(lm.tokenizer.encode(PROMPT))}
    warm_up(lm)
    app = build_app(lm, "tiny", max_queue=32)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Running(f"http://127.0.0.1:{port}", lm, app.state.server, expected)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_models_lists_the_served_model(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_completion_streamed_and_not(served):
    client = served.client()
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                           **GREEDY)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == served.expected["chat"]
    tokenizer = served.lm.tokenizer
    prompt = len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES),
                                  add_special_tokens=False))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens,
            reply.usage.total_tokens) == (prompt, 8, prompt + 8)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == served.expected["chat"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].object == \
        "chat.completion.chunk"


def test_completion_streamed_and_not_with_stop_and_seed(served):
    client = served.client()
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, **GREEDY)
    text = served.expected["completion"]
    assert done.choices[0].text == text and done.object == "text_completion"
    assert done.usage.prompt_tokens == served.expected["prompt_tokens"]
    assert done.usage.completion_tokens == 8
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, stream=True, **GREEDY)]
    assert len(pieces) > 2 and "".join(pieces) == text
    stop = text[3:5]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, stop=[stop],
                                    **GREEDY)
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                         temperature=1.5, top_p=0.95, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
               for seed in (3, 3, 4)]
    assert sampled[0] == sampled[1] != sampled[2]
    # the raw event stream: OpenAI's framing, ending with [DONE]
    with httpx.stream("POST", served.url + "/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_sixteen_concurrent_clients_get_what_each_gets_alone(served):
    prompts = [f"{word} {k}" for k, word in enumerate(["hello", "the", "in our", "there",
                                                        "well, ", "oh"] * 3)][:16]
    client = served.client()

    def one(prompt: str, k: int) -> Any:
        if k % 2:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=6 + k % 5,
                                             **GREEDY).choices[0].text
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}],
            max_tokens=6 + k % 5, **GREEDY).choices[0].message.content

    alone = [one(p, k) for k, p in enumerate(prompts)]
    aclient = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0,
                                 timeout=120)

    async def all_at_once() -> list[str]:
        async def run(prompt: str, k: int) -> Any:
            if k % 2:
                r = await aclient.completions.create(model="tiny", prompt=prompt,
                                                     max_tokens=6 + k % 5, **GREEDY)
                return r.choices[0].text
            stream = await aclient.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}],
                max_tokens=6 + k % 5, stream=True, **GREEDY)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        return list(await asyncio.gather(*(run(p, k) for k, p in enumerate(prompts))))

    steps = served.scheduler.steps
    together = asyncio.run(all_at_once())
    assert together == alone
    # several requests shared each step: far fewer steps than tokens decoded
    decoded = sum(5 + k % 5 for k in range(16))
    assert served.scheduler.steps - steps < decoded / 2


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_malformed_requests_get_openai_errors(served):
    url = served.url + "/v1/chat/completions"
    error = _error(httpx.post(url, content=b"{not json", headers={
        "content-type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    assert _error(httpx.post(url, json={"model": "tiny"}), 400)["param"] == "messages"
    assert _error(httpx.post(url, json={"messages": MESSAGES}), 400)["param"] == "model"
    assert _error(httpx.post(url, json={"model": "tiny", "messages": MESSAGES,
                                        "temperature": 7}), 400)["param"] == "temperature"
    assert _error(httpx.post(url, json={"model": "tiny", "messages": MESSAGES,
                                        "frobnicate": 1}), 400)["param"] == "frobnicate"
    assert _error(httpx.post(served.url + "/v1/completions", json={
        "model": "tiny", "prompt": [1, 9999]}), 400)["param"] == "prompt"
    assert _error(httpx.post(served.url + "/v1/completions", json={
        "model": "tiny", "prompt": "x" * 300}), 400)["code"] == "context_length_exceeded"
    assert _error(httpx.get(served.url + "/v1/nothing"), 404)["code"] == "not_found"
    with pytest.raises(openai.NotFoundError) as info:
        served.client().chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        served.client().completions.create(model="tiny", prompt=PROMPT, n=2)


def test_hanging_up_frees_the_slot_and_a_full_queue_answers_429(served, monkeypatch):
    scheduler = served.scheduler
    cancelled = scheduler.cancelled
    step = scheduler.batch.step

    def slow_step() -> Any:  # the tiny model's streams would end before the test hangs up
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(scheduler.batch, "step", slow_step)
    body = {"model": "tiny", "prompt": PROMPT, "stream": True, "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True}
    scheduler.max_queue = 0
    clients = [httpx.Client(timeout=30) for _ in range(served.lm.max_batch)]
    try:
        streams = []
        for c in clients:  # every slot runs a stream that would last until its cache is full
            stream = c.stream("POST", served.url + "/v1/completions", json=body)
            response = stream.__enter__()
            lines = response.iter_lines()  # kept: dropping it would close the stream
            first = next(line for line in lines if line)
            assert json.loads(first[len("data: "):])["choices"][0]["text"]
            streams.append((stream, lines))
        assert scheduler.running_count == served.lm.max_batch
        with pytest.raises(openai.RateLimitError) as info:
            served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 429 and info.value.body["code"] == \
            "rate_limit_exceeded"
        for stream, _ in streams:  # hang up mid-stream
            stream.__exit__(None, None, None)
    finally:
        for c in clients:
            c.close()
        scheduler.max_queue = 32
    deadline = time.monotonic() + 10
    while scheduler.running_count or scheduler.cancelled < cancelled + served.lm.max_batch:
        assert time.monotonic() < deadline, (scheduler.running_count, scheduler.cancelled)
        time.sleep(0.01)
    # the slots are free again and the server still serves
    done = served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                              **GREEDY)
    assert done.choices[0].text == served.expected["completion"]
