"""The pool's tokenizer on the gateway, without torch: the base model's `tokenizer.json` loaded with the `tokenizers`
library (the folder `service/model_files.tokenizer_folder` finds: the model's own, or the one the pool built the
preset in), and its `tokenizer_config.json` `chat_template` rendered with jinja2 (sandboxed, as transformers does).

Chat without a template (the tiny preset has none): each message as a line `"<role>: <content>"`, then `"assistant:"`
(`PLAIN_CHAT_FORMAT`). Completions encode with the tokenizer's special tokens (a BOS where its post-processor adds
one); a rendered chat template already holds them, so it is encoded without. Decoding skips special tokens (an EOS
the sample stopped at is not part of the text), as transformers' and vLLM's OpenAI servers do."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from loraplex.errors import InvalidRequestError, NotSupportedError
from loraplex.service.model_files import tokenizer_folder
from loraplex.settings import Settings

PLAIN_CHAT_FORMAT = "role: content lines, then 'assistant:'"


def plain_chat_prompt(messages: list[tuple[str, str]]) -> str:
    """The documented format for a model without a chat template: one `role: content` line each, then `assistant:`."""
    return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"


def _special(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@dataclass
class GatewayTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them
    folder: str

    @classmethod
    def load(cls, folder: str) -> GatewayTokenizer:
        root = Path(folder)
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config: dict[str, Any] = {}
        config_file = root / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = root / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text()
        specials = {name: tok for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                    if (tok := _special(config.get(name))) is not None}  # fmt: skip
        return cls(tokenizer, template if isinstance(template, str) else None, specials, str(root))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        """One token as text, for logprobs (special tokens included; a part of a multi-byte character shows as U+FFFD)."""
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def render_chat(self, messages: list[dict[str, Any]]) -> tuple[str, bool]:
        """(the prompt text, whether it came from the chat template). `messages`: role + content (a string)."""
        if self.chat_template is None:
            return plain_chat_prompt([(m["role"], m["content"]) for m in messages]), False
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, tools=None, documents=None, **self.special_tokens
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"the model's chat template refused these messages: {exc}") from None
        return text, True


_CACHE: dict[tuple[str, float, float], GatewayTokenizer] = {}
_LOCK = threading.Lock()


def gateway_tokenizer(settings: Settings, base_model: str) -> GatewayTokenizer:
    """The base model's tokenizer, loaded once per folder (and version of its files) in this process. A 400 while the
    gateway cannot see one (the pool writes the preset's folder when it first loads the model)."""
    folder = tokenizer_folder(settings, base_model)
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        raise NotSupportedError(
            "this gateway has no tokenizer.json for the base model (looked in the model's folder and the model "
            "cache); text in and out needs it"
        )
    config = Path(folder) / "tokenizer_config.json"
    key = (
        folder,
        (Path(folder) / "tokenizer.json").stat().st_mtime,
        config.stat().st_mtime if config.is_file() else 0.0,
    )
    with _LOCK:
        found = _CACHE.get(key)
        if found is None:
            found = _CACHE[key] = GatewayTokenizer.load(folder)
        return found
