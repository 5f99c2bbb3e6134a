"""A model folder's tokenizer (``tokenizer.json`` through the ``tokenizers`` package) and chat
template (Jinja, from ``tokenizer_config.json`` or ``chat_template.jinja``), read offline.

>>> # tok = Tokenizer.from_folder("path/to/model")
>>> # tok.decode(tok.encode("hello")) == "hello"
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from anygpu.llm.config import ModelFolderError, read_json


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text to token ids and back, plus the chat template and the special tokens."""

    def __init__(self, backend: Any, config: dict[str, Any], template: str | None,
                 folder: str) -> None:
        self.backend = backend
        self.folder = folder
        self.chat_template = template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.config = config
        self._compiled: Any = None

    @classmethod
    def from_folder(cls, folder: str) -> "Tokenizer":
        """Read ``tokenizer.json`` and, when present, ``tokenizer_config.json`` and
        ``chat_template.jinja``."""
        try:
            import tokenizers
        except ImportError as err:
            raise ImportError("anygpu.llm reads tokenizers with the 'tokenizers' package: "
                              "pip install 'anygpu[llm]'") from err
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelFolderError(f"{path}: not found (the tokenizer; give token ids instead "
                                   "of text to run without one)")
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as err:  # the Rust library raises its own exception types
            raise ModelFolderError(f"{path}: not a tokenizer the tokenizers package can read "
                                   f"({err})") from err
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = read_json(config_path, "the tokenizer's settings") \
            if os.path.exists(config_path) else {}
        template = cls._template(config, folder, config_path)
        return cls(backend, config, template, folder)

    @staticmethod
    def _template(config: dict[str, Any], folder: str, config_path: str) -> str | None:
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ModelFolderError(f"{config_path}: chat_template is not a string")
        return template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """The conversation as the model was trained to read it (the template rendered with
        Jinja in a sandbox, as Hugging Face renders it: ``messages``, ``add_generation_prompt``,
        the special tokens, ``raise_exception``)."""
        if self.chat_template is None:
            raise ModelFolderError(f"{self.folder}: the tokenizer has no chat_template "
                                   "(in tokenizer_config.json or chat_template.jinja)")
        if self._compiled is None:
            try:
                import jinja2
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError as err:
                raise ImportError("chat templates need jinja2: pip install 'anygpu[llm]'") \
                    from err

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            def tojson(value: Any, indent: int | None = None) -> str:
                return json.dumps(value, indent=indent, ensure_ascii=False)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            try:
                self._compiled = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError as err:
                raise ModelFolderError(f"{self.folder}: the chat template does not parse: "
                                       f"{err}") from err
        specials = {k: _token_text(v) for k, v in self.config.items()
                    if k.endswith("_token") and _token_text(v) is not None}
        return str(self._compiled.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**specials, **extra}))
