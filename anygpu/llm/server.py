"""``anygpu serve``: an OpenAI-compatible HTTP server for a local model folder.

    anygpu serve ./TinyLlama --host 127.0.0.1 --port 8000 --device cuda --max-batch 8

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models``, as
OpenAI's API has them (``stream: true`` gives server-sent events of OpenAI's chunks ending with
``data: [DONE]``), so OpenAI's clients work with ``base_url="http://HOST:PORT/v1"``.

One scheduler thread owns the model: it admits waiting requests into free slots of the cache
(each prefilled on its own), then runs one decode step for every running request at once
(``anygpu.llm.batch``), over and over; requests join and leave between steps (continuous
batching). The HTTP side (Starlette on uvicorn) parses and checks requests, tokenizes them and
hands them to the scheduler, which sends each new piece of text back to its request's event
loop. A client that hangs up has its request cancelled, and its slot is free before the next
step. At most ``max_queue`` requests wait for a slot; more are answered 429.

>>> # from anygpu import llm
>>> # from anygpu.llm.server import build_app
>>> # app = build_app(llm.load("TinyLlama", max_batch=8), "tinyllama")  # any ASGI server runs it
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from anygpu.llm.batch import CANCELLED, Batch, Generation
from anygpu.llm.engine import CacheFull, LanguageModel

ERROR = "error"  # the finish reason of a generation the scheduler could not run

# the request fields each endpoint reads; others are refused, not ignored
_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
           "stream_options", "n", "user", "presence_penalty", "frequency_penalty",
           "logprobs", "top_k", "min_p", "repetition_penalty", "ignore_eos"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


class RequestError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error object."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


class QueueFull(RequestError):
    def __init__(self, max_queue: int) -> None:
        super().__init__(f"the server is busy: every slot is running and {max_queue} requests "
                         "are waiting; try again later", status=429, code="rate_limit_exceeded",
                         kind="rate_limit_error")


# ---- the scheduler -----------------------------------------------------------------------------
class Scheduler:
    """The thread that runs ``lm``: waiting generations join free slots, then one decode step
    runs for all running ones; again until stopped. ``submit`` and ``cancel`` may be called
    from any thread."""

    def __init__(self, lm: LanguageModel, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {max_queue}")
        self.lm, self.max_queue = lm, max_queue
        self.batch = Batch(lm)
        self.waiting: collections.deque[Generation] = collections.deque()
        self.wake = threading.Condition()
        self.running_count = 0  # generations holding a slot (read from other threads)
        self.cancelled = 0  # generations ended by cancel, for tests and monitoring
        self.steps = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.broken: str | None = None  # why the scheduler's thread ended, if it failed

    def start(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="anygpu-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.wake:
            self._stop = True
            self.wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, generations: list[Generation]) -> None:
        """Queue ``generations`` (one request's) for slots; QueueFull, and none queued, when
        they would make more than ``max_queue`` wait."""
        with self.wake:
            if self.broken is not None:
                raise RequestError(f"the server's scheduler failed: {self.broken}",
                                   status=500, code="internal_error", kind="server_error")
            free = self.lm.max_batch - self.running_count
            if len(self.waiting) + len(generations) > free + self.max_queue:
                raise QueueFull(self.max_queue)
            self.waiting.extend(generations)
            self.wake.notify_all()

    def cancel(self, generation: Generation) -> None:
        """End ``generation`` (a client went away): it leaves its slot before the next step."""
        with self.wake:
            generation.cancelled = True
            self.wake.notify_all()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as err:  # a fault of the loop itself: no request waits forever
            self.broken = f"{type(err).__name__}: {err}"
            with self.wake:
                pending = list(self.waiting) + list(self.batch.running.values())
                self.waiting.clear()
            self._fail(pending, err)
            raise

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not self._stop and not self.waiting and not self.batch.running:
                    self.wake.wait()
                if self._stop:
                    break
                joining: list[Generation] = []
                while self.waiting and len(joining) < self.batch.free_slots:
                    joining.append(self.waiting.popleft())
                self.running_count = len(self.batch.running) + len(joining)
            ready = []
            for generation in joining:
                if generation.cancelled:
                    self.cancelled += 1
                    generation.finish(CANCELLED)
                    continue
                try:  # a prompt the model refuses ends that request only
                    self.batch.lm.check_prompt(generation.prompt)
                except ValueError as err:
                    self._fail([generation], err)
                    continue
                ready.append(generation)
            try:  # their prompts run in one pass; those whose pages are held wait, in order
                left = self.batch.add_many(ready)
            except CacheFull as err:  # nothing runs, and the first does not fit even alone
                self._fail(ready[:1], err)
                left = ready[1:]
            except Exception as err:  # a device failure ends the requests that were joining
                self._fail(ready, err)
                left = []
            if left:
                with self.wake:
                    self.waiting.extendleft(reversed(left))
            if self.batch.running:
                try:
                    ended = self.batch.step()
                except Exception as err:  # a device failure ends every running request
                    ended = []
                    self._fail(list(self.batch.running.values()), err)
                self.steps += 1
                self.cancelled += sum(g.finish_reason == CANCELLED for g in ended)
            with self.wake:
                self.running_count = len(self.batch.running)
        for generation in list(self.waiting) + list(self.batch.running.values()):
            generation.finish(CANCELLED)

    def _fail(self, generations: list[Generation], err: Exception) -> None:
        for generation in generations:
            generation.error = f"{type(err).__name__}: {err}"
            if generation.slot is not None:
                self.batch.running.pop(generation.slot, None)
            generation.finish(ERROR)


# ---- requests ----------------------------------------------------------------------------------
@dataclass
class Job:
    """One HTTP request's generations (a completion may have several prompts) and the events
    the scheduler sends back: (choice index, text piece, finish reason or None)."""

    generations: list[Generation]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def listen(self, loop: asyncio.AbstractEventLoop) -> None:
        for index, generation in enumerate(self.generations):
            def on_token(g: Generation, piece: str, index: int = index) -> None:
                try:
                    loop.call_soon_threadsafe(self.queue.put_nowait,
                                              (index, piece, g.finish_reason))
                except RuntimeError:  # the event loop has closed: the server is stopping
                    pass
            generation.on_token = on_token

    @property
    def usage(self) -> dict[str, int]:
        prompt = sum(len(g.prompt) for g in self.generations)
        completion = sum(len(g.tokens) for g in self.generations)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {json.dumps(value)}", param=name)
    if value > high or value < low or (low_open and value == low):
        side = "(" if low_open else "["
        raise RequestError(f"{name} must be in {side}{low}, {high}], got {value}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {json.dumps(value)}", param=name)
    if value < low:
        raise RequestError(f"{name} must be at least {low}, got {value}", param=name)
    return value


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", param="stop")
    return stops


def _refuse(body: dict[str, Any], name: str, allowed: Callable[[Any], bool], why: str) -> None:
    if name in body and body[name] is not None and not allowed(body[name]):
        raise RequestError(f"{name}: {why}", param=name)


class Server:
    """The ASGI application's state: the model, its name, the scheduler."""

    def __init__(self, lm: LanguageModel, model_name: str, max_queue: int = 64) -> None:
        if lm.tokenizer is None:
            raise ValueError(f"{lm.folder}: serving needs the model's tokenizer.json")
        self.lm, self.model_name = lm, model_name
        self.names = {model_name, lm.folder, os.path.basename(os.path.normpath(lm.folder))}
        self.scheduler = Scheduler(lm, max_queue)
        self.created = int(time.time())

    # ---- request bodies into generations -----------------------------------------------------
    def _check(self, body: Any, fields: set[str]) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise RequestError(f"unrecognized request argument supplied: {unknown[0]}",
                               param=unknown[0])
        model = body.get("model")
        if not isinstance(model, str):
            raise RequestError("you must provide a model parameter (a string)", param="model")
        if model not in self.names:
            raise RequestError(f"the model '{model}' does not exist; this server has "
                               f"'{self.model_name}'", status=404, param="model",
                               code="model_not_found")
        _refuse(body, "n", lambda v: v == 1, "only 1 choice per prompt is supported")
        _refuse(body, "best_of", lambda v: v == 1, "only 1 is supported")
        _refuse(body, "echo", lambda v: v is False, "echoing the prompt is not supported")
        _refuse(body, "suffix", lambda v: False, "suffixes are not supported")
        _refuse(body, "logprobs", lambda v: v is False, "log probabilities are not supported")
        _refuse(body, "top_logprobs", lambda v: False, "log probabilities are not supported")
        for name in ("presence_penalty", "frequency_penalty"):
            _refuse(body, name, lambda v: v == 0, "not supported (use repetition_penalty)")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be true or false", param="stream")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or
                                    set(options) - {"include_usage"}):
            raise RequestError("stream_options may only have include_usage",
                               param="stream_options")
        return body

    def _generation(self, body: dict[str, Any], ids: list[int], default_tokens: int,
                    tokens_field: str) -> Generation:
        lm = self.lm
        vocab = lm.config.vocab_size
        if not ids:
            raise RequestError("the prompt has no tokens", param="prompt")
        if any(not 0 <= i < vocab for i in ids):
            raise RequestError(f"token ids must be in 0..{vocab - 1}", param="prompt")
        if len(ids) > lm.max_seq_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than the server's "
                               f"context of {lm.max_seq_len} (--max-seq-len)",
                               param=tokens_field, code="context_length_exceeded")
        max_tokens = _integer(body, tokens_field, 1)
        if max_tokens is None:
            max_tokens = default_tokens
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError("seed must be an integer", param="seed")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise RequestError("ignore_eos must be true or false", param="ignore_eos")
        top_k = _integer(body, "top_k", 0)
        try:
            return lm.generation(
                ids, max_new_tokens=max_tokens,
                temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                top_k=top_k or 0, min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 1e9, True),
                seed=seed, stop=_stops(body), ignore_eos=ignore_eos, as_text=True)
        except ValueError as err:
            raise RequestError(str(err)) from err

    def chat_job(self, body: Any) -> Job:
        body = self._check(body, CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a role",
                                   param=f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):  # parts: only text ones
                if not all(isinstance(p, dict) and p.get("type") == "text" and
                           isinstance(p.get("text"), str) for p in content):
                    raise RequestError(f"messages[{i}].content: only text parts are supported",
                                       param=f"messages[{i}].content")
                m = {**m, "content": "".join(p["text"] for p in content)}
                messages[i] = m
            elif not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be a string",
                                   param=f"messages[{i}].content")
        tokenizer = self.lm.tokenizer
        assert tokenizer is not None
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as err:  # the template's own raise_exception, or a bad message
            raise RequestError(f"the chat template refused the messages: {err}",
                               param="messages") from err
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
        tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        return Job([self._generation(body, ids, self.lm.max_seq_len, tokens_field)])

    def completion_job(self, body: Any) -> Job:
        body = self._check(body, COMPLETION_FIELDS)
        prompt = body.get("prompt")
        tokenizer = self.lm.tokenizer
        assert tokenizer is not None

        def is_ids(p: Any) -> bool:
            return isinstance(p, list) and bool(p) and \
                all(isinstance(i, int) and not isinstance(i, bool) for i in p)

        if isinstance(prompt, str) or is_ids(prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and \
                all(isinstance(p, str) or is_ids(p) for p in prompt):
            prompts = prompt
        else:
            raise RequestError("prompt must be a string, a list of token ids, or a non-empty "
                               "list of either", param="prompt")
        ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return Job([self._generation(body, i, 16, "max_tokens") for i in ids])

    # ---- the endpoints -----------------------------------------------------------------------
    async def run(self, request: Any, chat: bool) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"the request body is not valid JSON: {err}") from err
        job = self.chat_job(body) if chat else self.completion_job(body)
        job.listen(asyncio.get_running_loop())
        self.scheduler.submit(job.generations)  # QueueFull: 429
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._events(job, ident, chat, usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await self._wait(job, request)
        self._raise_failure(job)
        choices = []
        for index, g in enumerate(job.generations):
            if chat:
                choices.append({"index": index, "logprobs": None, "finish_reason": g.finish_reason,
                                "message": {"role": "assistant", "content": g.output}})
            else:
                choices.append({"index": index, "text": g.output, "logprobs": None,
                                "finish_reason": g.finish_reason})
        return JSONResponse({"id": ident, "object": "chat.completion" if chat else
                             "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": job.usage})

    async def _wait(self, job: Job, request: Any) -> None:
        """Until every generation of ``job`` ends; the client hanging up cancels them."""
        left = len(job.generations)
        try:
            while left:
                try:
                    _, _, reason = await asyncio.wait_for(job.queue.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                left -= reason is not None
        finally:
            self._cancel_unfinished(job)

    def _cancel_unfinished(self, job: Job) -> None:
        for generation in job.generations:
            if not generation.done:
                self.scheduler.cancel(generation)

    @staticmethod
    def _raise_failure(job: Job) -> None:
        for g in job.generations:
            if g.finish_reason == ERROR:
                raise RequestError(f"the model failed: {g.error}", status=500,
                                   kind="server_error")

    async def _events(self, job: Job, ident: str, chat: bool, usage: bool
                      ) -> AsyncIterator[str]:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return "data: " + json.dumps({"id": ident, "object": kind, "created": created,
                                          "model": self.model_name, "choices": choices,
                                          **extra}) + "\n\n"

        def choice(index: int, piece: str | None, reason: str | None) -> dict[str, Any]:
            if not chat:
                return {"index": index, "text": piece or "", "logprobs": None,
                        "finish_reason": reason}
            delta = {} if piece is None else {"content": piece}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

        try:
            if chat:
                for index in range(len(job.generations)):
                    yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            left = len(job.generations)
            while left:
                index, piece, reason = await job.queue.get()
                if reason == ERROR:
                    error = RequestError(f"the model failed: {job.generations[index].error}",
                                         status=500, kind="server_error")
                    yield "data: " + json.dumps(error.body()) + "\n\n"
                    return
                if piece:
                    yield chunk([choice(index, piece, None)])
                if reason is not None:
                    left -= 1
                    yield chunk([choice(index, None if chat else "", reason)])
            if usage:
                yield chunk([], usage=job.usage)
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the stream was cancelled), or the stream ended
            self._cancel_unfinished(job)

    async def models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created,
             "owned_by": "anygpu", "max_model_len": self.lm.max_seq_len}]})


def build_app(lm: LanguageModel, model_name: str, max_queue: int = 64) -> Any:
    """The Starlette (ASGI) application serving ``lm`` as ``model_name``; its scheduler thread
    starts and stops with the application's lifespan. ``app.state.server`` is the ``Server``."""
    try:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route
    except ImportError as err:
        raise ImportError("anygpu serve needs starlette and uvicorn: pip install "
                          "'anygpu[serve]'") from err
    import contextlib

    server = Server(lm, model_name, max_queue)

    def endpoint(chat: bool) -> Callable[[Request], Any]:
        async def run(request: Request) -> Response:
            return await server.run(request, chat)
        return run

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else None
        error = RequestError(f"{request.method} {request.url.path}: {exc.detail}",
                             status=exc.status_code, code=code)
        return JSONResponse(error.body(), status_code=exc.status_code)

    async def failed(request: Request, exc: Exception) -> Response:
        error = RequestError(f"the server failed: {type(exc).__name__}: {exc}", status=500,
                             kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop()

    routes = [Route("/v1/chat/completions", endpoint(True), methods=["POST"]),
              Route("/v1/completions", endpoint(False), methods=["POST"]),
              Route("/v1/models", server.models, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={RequestError: refused, HTTPException: http_error,
                                        Exception: failed})
    app.state.server = server
    return app


def warm_up(lm: LanguageModel) -> None:
    """Compile the decode steps of every size (their plain runs, captures and replays) and a
    one-token prefill before the first request."""
    lm.warm_up()
    lm.prefill([lm.config.bos_token_id or 0])
    lm.reset()


__all__ = ["build_app", "warm_up", "Server", "Scheduler", "RequestError"]
