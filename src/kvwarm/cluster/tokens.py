"""A prompt's token ids at the ingress, for routing: the model's vocabulary alone.

The router scores replicas by the chunks of a prompt each could restore, keyed from its token
ids as the cache keys them (``routing/index.py``). The ingress has no engine, so it loads each
model's vocabulary only (``ModelParams.vocab_only``: no weights, no context; what ``kvwarm
cache explain`` does) and renders a chat with the template the replicas use.

Invariants: these tokens decide only where a request goes; the replica tokenizes the request
again from its messages or text, so a difference (a template option the ingress does not
render the same) costs a worse placement, never a wrong answer: the prompt's chunks then do
not match and routing falls back to rows and chains. A model whose vocabulary cannot be
loaded here (its file is not on this node) is routed without tokens. Tokenizing runs on the
caller's thread (the routes submit generations from the thread pool), one at a time per
model.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvwarm.backends.base import BackendModel
    from kvwarm.engine.ops import Message
    from kvwarm.engine.types import GenerationOptions
    from kvwarm.settings import ModelSpec, Settings

log = logging.getLogger("kvwarm.cluster.tokens")

__all__ = ["PromptTokens"]


class PromptTokens:
    def __init__(self, bmodel: BackendModel, template: str | None) -> None:
        """``template``: the Jinja source chats render with (None: the model's own)."""
        self._bmodel = bmodel
        self._template = template
        self._lock = threading.Lock()

    @classmethod
    def load(cls, settings: Settings, spec: ModelSpec) -> PromptTokens | None:
        """The vocabulary of ``spec``'s model, or None (logged) when it cannot be loaded here."""
        from kvwarm.backends import get_backend
        from kvwarm.backends.chat_template import (
            BUILTIN_TEMPLATES,
            FALLBACK_TEMPLATE,
            resolve_template,
        )
        from kvwarm.settings.model import model_config

        try:
            cfg = model_config(settings, spec)
            chosen = cfg.backend or settings.backend
            backend = get_backend(chosen) if isinstance(chosen, str) else chosen
            path = backend.locate(spec.path)
            params = dataclasses.replace(cfg.model_params, vocab_only=True)
            bmodel = backend.load_model(str(path), params)
        except Exception as exc:
            log.warning(
                "model %s: no vocabulary at the ingress (%s): routed without its prompt's chunks",
                spec.model_id,
                exc,
            )
            return None
        template: str | None = None
        if cfg.chat_template is not None:
            template = resolve_template(cfg.chat_template)[1]
        elif not bmodel.facts.chat_template:
            template = BUILTIN_TEMPLATES[FALLBACK_TEMPLATE]
        return cls(bmodel, template)

    def chat(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, object]] | None
    ) -> tuple[int, ...]:
        from kvwarm.engine.prompts import chat_tokens

        with self._lock:
            tokens, _ = chat_tokens(self._bmodel, messages, tools=tools, template=self._template)
        return tuple(tokens)

    def text(self, prompt: str | Sequence[int], options: GenerationOptions) -> tuple[int, ...]:
        if not isinstance(prompt, str):
            return tuple(prompt)
        with self._lock:
            tokens = self._bmodel.tokenize(
                prompt, add_special=options.add_special, parse_special=options.parse_special
            )
        return tuple(tokens)

    def close(self) -> None:
        self._bmodel.close()
