"""The stub backend's multimodal projector: any path loads; media become seeded embeddings.

An image is laid out as the text ``<img>``, ``media_tokens`` positions of embeddings and
``</img>`` (as Gemma 3's projector frames its images with marker tokens); a clip as ``<audio>``,
one position per started quarter second, ``</audio>``. The embeddings are a pure function of
the media's digest, so the same pixels give the same span and its KV, as on llama.cpp.

Invariant: the same protocol and errors as ``backends/llama/projector.py``: a kind the
projector was not made for is an ``InvalidRequestError``; ``encode`` runs one at a time.
``StubBackend.encode_gate`` (a ``threading.Event``), when set on the backend, holds every
encode until it is set, so a test can see other slots decode while a span is encoded.
"""

from __future__ import annotations

import hashlib
import math
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvwarm.backends.base import LayoutPiece, MediaSpan, ProjectorFacts, ProjectorParams
from kvwarm.backends.lifetime import Lifetime
from kvwarm.backends.stub.vocab import N_EMBD, OFFSET
from kvwarm.errors import BackendError, InvalidRequestError
from kvwarm.media import Audio, Media, MediaKind

if TYPE_CHECKING:
    from kvwarm.backends.stub import StubModel

AUDIO_RATE = 16000


def _text(s: str) -> tuple[int, ...]:
    return tuple(b + OFFSET for b in s.encode())


class StubProjector:
    def __init__(self, model: StubModel, path: str, params: ProjectorParams) -> None:
        backend = model.backend
        self._model = model
        self._tokens = backend.media_tokens
        kinds: tuple[MediaKind, ...] = (
            ("image", "audio") if "audio" in Path(path).name else ("image",)
        )
        self._facts = ProjectorFacts(
            path=path,
            kinds=kinds,
            n_embd=N_EMBD,
            non_causal=("image",),  # as Gemma 3's: its images both ways, audio causal
            audio_sample_rate=AUDIO_RATE if "audio" in kinds else 0,
            memory_bytes=1 << 20,
            description=Path(path).name,
        )
        self._lock = threading.Lock()
        self.encoded = 0  # how many encodes ran (tests count them)
        model._life.acquire()
        self._life = Lifetime("projector", model._life.release)

    @property
    def facts(self) -> ProjectorFacts:
        return self._facts

    def layout(self, media: Media) -> tuple[LayoutPiece, ...]:
        with self._life.using():
            if media.kind not in self._facts.kinds:
                raise InvalidRequestError(
                    f"this model's projector reads {' and '.join(self._facts.kinds)}, "
                    f"not {media.kind}",
                    param="messages",
                )
            if isinstance(media, Audio):
                n = max(1, math.ceil(4 * media.n_samples / media.sample_rate))
                return (_text("<audio>"), MediaSpan(n, "audio"), _text("</audio>"))
            return (_text("<img>"), MediaSpan(self._tokens, "image"), _text("</img>"))

    def encode(self, media: Media, index: int) -> bytes:
        with self._life.using(), self._lock:
            gate = self._model.backend.encode_gate
            if gate is not None:
                gate.wait()
            spans = [p for p in self.layout(media) if isinstance(p, MediaSpan)]
            if not 0 <= index < len(spans):
                raise BackendError(f"the {media.kind} has no span {index}")
            if self._model.backend.encode_error is not None:
                raise BackendError(self._model.backend.encode_error)
            seed = int.from_bytes(
                hashlib.sha256(media.digest + bytes([index])).digest()[:8], "little"
            )
            rows = np.random.default_rng(seed).standard_normal(spans[index].n_tokens * N_EMBD)
            self.encoded += 1
            return rows.astype("<f4").tobytes()

    def close(self) -> None:
        self._life.close()
