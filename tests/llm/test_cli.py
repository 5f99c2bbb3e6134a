"""``anygpu generate`` and ``anygpu chat`` on a tiny model folder (on the cpu: the commands
do nothing device-specific)."""

from __future__ import annotations

import pytest

from anygpu.cli.main import main

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


def test_generate_prints_the_prompt_and_its_continuation(tiny, capsys):
    folder = tiny("llama")[0]
    assert main(["generate", folder, "--prompt", "hello ", "--max-new-tokens", "6",
                 "--max-seq-len", "32", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("hello ") and len(out) > len("hello \n")
    assert "prefill: 6 tokens" in err and "decode: 5 tokens" in err
    assert main(["generate", folder + "/nowhere", "--prompt", "x"]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_chat_streams_replies_and_takes_commands(tiny, capsys, monkeypatch):
    lines = iter(["hi there", "/stats", "again", "/reset", "", "one more", "/exit", "unread"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", tiny("llama")[0], "--max-new-tokens", "5", "--max-seq-len", "96",
                 "--temperature", "0.8", "--top-k", "5", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "/stats: speeds of the last reply" in out
    assert "tokens/s" in out and "(new conversation)" in out
    assert next(lines) == "unread"


def test_generate_with_quantized_weights(tiny, capsys):
    folder = tiny("llama")[0]
    assert main(["generate", folder, "--prompt", "hello ", "--max-new-tokens", "4",
                 "--max-seq-len", "32", "--quant", "q8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hello ") and len(out) > len("hello \n")


def test_serve_answers_over_http(tiny):
    """``anygpu serve`` as a user starts it: its own process on a free port, asked for its
    models and a completion, then stopped."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    folder = tiny("llama")[0]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "ANYGPU_DEVICE": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "anygpu.cli.main", "serve", folder, "--port", str(port),
         "--max-seq-len", "64", "--max-batch", "2", "--model-name", "tiny",
         "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 240  # the decode steps compile first
        while True:
            try:
                with urllib.request.urlopen(base + "/models", timeout=5) as response:
                    models = json.load(response)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read() if proc.stdout else ""
                    pytest.fail(f"anygpu serve did not answer:\n{out}")
                time.sleep(0.5)
        assert [m["id"] for m in models["data"]] == ["tiny"]
        body = json.dumps({"model": "tiny", "prompt": "hello ", "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request(base + "/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.load(response)
        assert completion["usage"]["completion_tokens"] >= 1
        assert isinstance(completion["choices"][0]["text"], str)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
