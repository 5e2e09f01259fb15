"""Tokenizer of a Hugging Face checkpoint: `tokenizer.json` via the `tokenizers` library.

Special tokens and the chat template come from `tokenizer_config.json` (the template may also
be a separate `chat_template.jinja`, as newer checkpoints ship it). Templates are rendered with a
sandboxed jinja2 environment that offers what transformers offers them: `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, `bos_token` / `eos_token` variables.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_FILE = "tokenizer.json"


def _token_text(value: Any) -> str | None:
    """tokenizer_config special-token entries are a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pick_template(template: Any) -> str | None:
    """A template string, or the "default" one of a named list [{name, template}, ...]."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class HFTokenizer:
    """encode / decode / chat template over a `tokenizers.Tokenizer`.

    eos_token_id: the tokenizer's eos token, else the first of the model's eos ids.
    """

    def __init__(self, tokenizer, *, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, model_eos: Sequence[int] = ()) -> None:  # fmt: skip
        config = dict(config or {})
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.bos_token_id = self._id(self.bos_token)
        eos = self._id(self.eos_token)
        self.eos_token_id = eos if eos is not None else (model_eos[0] if model_eos else None)
        self.pad_token_id = self._id(self.pad_token)
        self.chat_template = chat_template or _pick_template(config.get("chat_template"))
        self._compiled: Template | None = None  # the chat template, compiled on first use

    @classmethod
    def from_dir(cls, path: str, model_eos: Sequence[int] = ()) -> HFTokenizer:
        """Loads `path/tokenizer.json` (+ tokenizer_config.json, chat_template.jinja)."""
        from tokenizers import Tokenizer

        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            raise ValueError(f"{path}: no {TOKENIZER_FILE} (only fast tokenizers are supported)")
        template = None
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        return cls(Tokenizer.from_file(file), config=config, chat_template=template, model_eos=model_eos)

    @property
    def backend(self):
        """The wrapped `tokenizers.Tokenizer` (structured outputs hand it to llguidance)."""
        return self._tok

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; the tokenizer's post-processor adds BOS etc. when asked."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:  # fmt: skip
        """Renders the chat template (text; encode it with add_special_tokens=False since the
        template writes BOS itself). ValueError when the checkpoint has no template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = _environment().from_string(self.chat_template)
        return self._compiled.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **kwargs,
        )


def _environment() -> ImmutableSandboxedEnvironment:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 ships with transformers / fastapi
        raise ValueError("chat templates need jinja2 (pip install jinja2)") from e

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env
