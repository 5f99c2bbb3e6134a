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
