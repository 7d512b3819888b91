"""A model's multimodal projector (``--mmproj``) over llama.cpp's ``mtmd``: decoded media in,
the text model's input embeddings out.

Invariants:

- mtmd only ever sees raw pixels or samples (``mtmd_bitmap_init``), decoded and bounded in
  Python (``kvwarm.media``), never a file, and never text a user wrote: its tokenizer is given
  the media marker alone, so a marker in a message stays text.
- A projector is refused at load, before any request, where using it would reach a
  ``GGML_ASSERT`` or give a prompt the engine cannot lay out: marker tokens the vocabulary
  lacks (the ``idefics3`` projector with SmolLM2), positions that are not one per embedding
  (M-RoPE), embeddings wider than the model's input. A chunk from the encoder is checked
  against the layout the prompt was built from before its embeddings are read.
- ``encode`` runs one at a time (a lock): mtmd's encoder keeps its output in the context.
  A medium is tokenized (preprocessed) once for all its spans' encodes, held until its last
  span's, another medium's encode, or ``close``.
  ``layout`` tokenizes a placeholder (no pixels, nothing encoded) and is safe from any thread.
- The projector holds its model open (``lifetime``) until ``mtmd_free`` has run, once; the
  log callback mtmd calls is referenced for the life of the process (``native``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvwarm.backends.base import LayoutPiece, MediaSpan, ProjectorFacts, ProjectorParams
from kvwarm.backends.lifetime import Lifetime
from kvwarm.backends.llama import model_file
from kvwarm.backends.llama import native as _native
from kvwarm.errors import BackendError, InvalidRequestError, MediaError, ModelLoadError
from kvwarm.media import MIN_AUDIO_SAMPLES, Audio, Image, Media, MediaKind
from kvwarm.models_dir import check_gguf_magic

if TYPE_CHECKING:
    from kvwarm.backends.llama.model import LlamaModel

log = logging.getLogger(__name__)

_TEXT, _IMAGE, _AUDIO = 0, 1, 2
_KINDS: dict[int, MediaKind] = {_IMAGE: "image", _AUDIO: "audio"}

# The marker mtmd's tokenizer replaces with a bitmap. Only kvwarm's own text reaches it (the
# marker alone), so any marker will do; this one is mtmd's default.
_MARKER = b"<__media__>"


def _mtmd() -> Any:
    """``llama_cpp.mtmd_cpp``, with mtmd's log routed like llama.cpp's (``native``)."""
    _native.lib()
    try:
        from llama_cpp import mtmd_cpp
    except (ImportError, OSError) as exc:
        raise ModelLoadError(f"this llama-cpp-python has no usable libmtmd: {exc}") from exc
    _native.route_mtmd_log(mtmd_cpp)
    return mtmd_cpp


class LlamaProjector:
    """``Projector`` over ``mtmd_init_from_file``."""

    def __init__(self, model: LlamaModel, path: str, params: ProjectorParams) -> None:
        if "\0" in path or not Path(path).is_file():
            raise ModelLoadError(f"no projector file at {path!r}")
        try:
            check_gguf_magic(path)
        except InvalidRequestError as exc:
            raise ModelLoadError(f"the projector {path!r} is not a GGUF file") from exc
        # Keys mtmd's loader or encoder graph would abort the process on.
        model_file.check_path(path, projector=True)
        mt = _mtmd()
        self._mt = mt
        self._model = model
        self._lock = threading.Lock()
        # (digest, chunks, bitmap, span chunks) of the medium being encoded (_spans_of).
        self._held: tuple[bytes, object, object, list[object]] | None = None
        cp = mt.mtmd_context_params_default()
        cp.use_gpu = bool(params.use_gpu)
        cp.n_threads = params.n_threads or _native.default_threads()
        cp.print_timings = False
        cp.warmup = True  # allocates its compute buffers now, so their size is known
        cp.media_marker = _MARKER
        self._params = cp  # C keeps the marker's pointer for the context's life
        model.lifetime.acquire()
        _native.graphs_may_run()  # its warmup runs the encoder's graph
        try:
            with model.lifetime.using(), _native.captured_log() as lines:
                ptr = mt.mtmd_init_from_file(os.fsencode(path), model.native, cp)
            if not ptr:
                detail = next((ln.strip() for ln in reversed(lines) if "error" in ln), "")
                raise ModelLoadError(
                    f"llama.cpp could not load the projector {path!r} for this model"
                    + (f": {detail}" if detail else "")
                )
            self._ptr: object = ptr
            try:
                self._facts = self._read_facts(path, lines)
                self._facts = replace(self._facts, non_causal=self._check_layout())
            except BaseException:
                mt.mtmd_free(ptr)
                raise
        except BaseException:
            model.lifetime.release()
            raise
        self._life = Lifetime("projector", self._free)

    def _read_facts(self, path: str, lines: list[str]) -> ProjectorFacts:
        mt, ptr, lib = self._mt, self._ptr, self._model._lib
        if bool(mt.mtmd_decode_use_mrope(ptr)):
            # Its positions are (t, x, y) per embedding, not one id per position: a Prompt
            # cannot carry them yet.
            raise ModelLoadError(
                f"the projector {path!r} places embeddings with M-RoPE (Qwen-VL-style), "
                "which kvwarm does not support yet"
            )
        kinds: list[MediaKind] = []
        if bool(mt.mtmd_support_vision(ptr)):
            kinds.append("image")
        if bool(mt.mtmd_support_audio(ptr)):
            kinds.append("audio")
        if not kinds:
            raise ModelLoadError(f"the projector {path!r} reads neither images nor audio")
        rate = int(mt.mtmd_get_audio_sample_rate(ptr)) if "audio" in kinds else 0
        size = Path(path).stat().st_size
        compute = sum(round(float(mib) * (1 << 20)) for line in lines for mib in _compute_mib(line))
        return ProjectorFacts(
            path=path,
            kinds=tuple(kinds),
            n_embd=int(lib.llama_model_n_embd_inp(self._model.native)),
            non_causal=(),  # per kind, from a chunk of each (_check_layout)
            audio_sample_rate=max(rate, 0),
            memory_bytes=size + compute,
            description=Path(path).name,
        )

    def _check_layout(self) -> tuple[MediaKind, ...]:
        """Lay out a small placeholder of each kind: every marker token must be this
        vocabulary's, every span one position per embedding. Returns the kinds whose spans
        attend to themselves both ways (mtmd answers per chunk)."""
        both_ways: list[MediaKind] = []
        probes: list[Media] = []
        if "image" in self._facts.kinds:
            probes.append(Image(8, 8, bytes(8 * 8 * 3)))
        if "audio" in self._facts.kinds:
            rate = self._facts.audio_sample_rate or 16000
            probes.append(Audio(bytes(4 * rate), rate))
        n_vocab = self._model.n_vocab
        for probe in probes:
            try:
                pieces = self._layout(probe, check_pos=True, non_causal=both_ways)
            except InvalidRequestError as exc:
                raise ModelLoadError(
                    f"the projector cannot lay out an {probe.kind}: {exc}"
                ) from exc
            for piece in pieces:
                if isinstance(piece, tuple) and any(not 0 <= t < n_vocab for t in piece):
                    raise ModelLoadError(
                        f"the projector marks an {probe.kind} with tokens this model's "
                        "vocabulary does not have (a projector made for another model)"
                    )
        return tuple(both_ways)

    @property
    def facts(self) -> ProjectorFacts:
        return self._facts

    @property
    def lifetime(self) -> Lifetime:
        return self._life

    # -- layout and encoding --------------------------------------------------------------

    def layout(self, media: Media) -> tuple[LayoutPiece, ...]:
        with self._life.using():
            return self._layout(media, check_pos=False)

    def _layout(
        self, media: Media, *, check_pos: bool, non_causal: list[MediaKind] | None = None
    ) -> tuple[LayoutPiece, ...]:
        if media.kind not in self._facts.kinds:
            raise InvalidRequestError(
                f"this model's projector reads {' and '.join(self._facts.kinds)}, not {media.kind}",
                param="messages",
            )
        with self._chunks(media, placeholder=True) as chunks:
            out: list[LayoutPiece] = []
            for chunk, kind, tokens in chunks:
                if kind == _TEXT:
                    out.append(tokens)
                    continue
                n = int(self._mt.mtmd_input_chunk_get_n_tokens(chunk))
                if check_pos and int(self._mt.mtmd_input_chunk_get_n_pos(chunk)) != n:
                    raise ModelLoadError("a span's positions are not one per embedding")
                both = bool(self._mt.mtmd_decode_use_non_causal(self._ptr, chunk))
                if non_causal is not None and both and _KINDS[kind] not in non_causal:
                    non_causal.append(_KINDS[kind])
                out.append(MediaSpan(n, _KINDS[kind]))
            return tuple(out)

    def encode(self, media: Media, index: int) -> bytes:
        with self._life.using(), self._lock:
            mt = self._mt
            spans = self._spans_of(media)
            if not 0 <= index < len(spans):
                raise BackendError(f"the {media.kind} has no span {index}")
            chunk = spans[index]
            try:
                n = int(mt.mtmd_input_chunk_get_n_tokens(chunk))
                rc = int(mt.mtmd_encode_chunk(self._ptr, chunk))
                if rc != 0:
                    raise BackendError(f"the projector failed to encode an {media.kind} ({rc})")
                ptr = mt.mtmd_get_output_embd(self._ptr)
                if not ptr:
                    raise BackendError("the projector returned no embeddings")
                width = self._facts.n_embd
                embd = np.ctypeslib.as_array(ptr, shape=(n * width,)).astype("<f4")
            except BaseException:
                self._drop_held()
                raise
            if index == len(spans) - 1:  # its last span: nothing left to hold it for
                self._drop_held()
        if not np.isfinite(embd).all():
            # Finite input can still overflow (float samples of 1e30 do): NaN embeddings
            # would give NaN logits, and a reply of nothing real.
            raise MediaError(
                f"the projector's embeddings of this {media.kind} are not finite numbers "
                "(its values overflow the encoder)",
                param="messages",
            )
        return embd.tobytes()

    def _spans_of(self, media: Media) -> list[object]:
        """mtmd's chunks of ``media``'s spans, tokenized once and held (``_held``, under
        ``_lock``) across the encodes of its spans, until the last one's or another
        medium's. Found by review: each span's encode tokenized the whole medium again
        (a clip's mel spectrogram, every 30 s window of it), so a clip of N windows was
        preprocessed N times, quadratic in its length."""
        held = self._held
        if held is not None and held[0] == media.digest:
            return held[3]
        self._drop_held()
        chunks, bitmap, out = self._tokenize(media, placeholder=False)
        spans = [chunk for chunk, kind, _ in out if kind != _TEXT]
        self._held = (media.digest, chunks, bitmap, spans)
        return spans

    def _drop_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._release(held[1], held[2])

    @contextmanager
    def _chunks(
        self, media: Media, *, placeholder: bool
    ) -> Iterator[list[tuple[object, int, tuple[int, ...]]]]:
        """mtmd's chunks for ``media`` alone: (chunk, type, text tokens); freed on exit."""
        chunks, bitmap, out = self._tokenize(media, placeholder=placeholder)
        try:
            yield out
        finally:
            self._release(chunks, bitmap)

    def _release(self, chunks: object, bitmap: object) -> None:
        self._mt.mtmd_input_chunks_free(chunks)
        self._mt.mtmd_bitmap_free(bitmap)

    def _tokenize(
        self, media: Media, *, placeholder: bool
    ) -> tuple[object, object, list[tuple[object, int, tuple[int, ...]]]]:
        """(mtmd's chunk list, its bitmap, and per chunk: (chunk, type, text tokens)) for
        ``media`` alone; the caller frees the first two (``_release``)."""
        mt = self._mt
        data: Any = None
        if isinstance(media, Image):
            if not placeholder:
                data = (ctypes.c_uint8 * len(media.rgb)).from_buffer_copy(media.rgb)
            bitmap = mt.mtmd_bitmap_init(media.width, media.height, data)
        else:
            if media.n_samples < MIN_AUDIO_SAMPLES:
                # mtmd_tokenize asserts more than one sample: a GGML_ASSERT, an abort.
                raise MediaError(
                    f"an audio clip of {media.n_samples} sample is too short (at least "
                    f"{MIN_AUDIO_SAMPLES})",
                    param="messages",
                )
            if not placeholder:
                data = (ctypes.c_float * media.n_samples).from_buffer_copy(media.samples)
            bitmap = mt.mtmd_bitmap_init_from_audio(media.n_samples, data)
        if not bitmap:
            raise BackendError(f"mtmd could not hold the {media.kind}")
        chunks = mt.mtmd_input_chunks_init()
        try:
            text = mt.mtmd_input_text()
            text.text = _MARKER
            text.text_len = len(_MARKER)
            text.add_special = False
            text.parse_special = True
            bitmaps = (mt.mtmd_bitmap_p_ctypes * 1)(bitmap)
            with _native.captured_log() as lines:
                rc = int(mt.mtmd_tokenize(self._ptr, chunks, ctypes.byref(text), bitmaps, 1))
            if rc != 0:
                why = next((ln.strip() for ln in reversed(lines) if "error" in ln), "")
                raise InvalidRequestError(
                    f"the projector cannot read this {media.kind}" + (f": {why}" if why else ""),
                    param="messages",
                )
            out: list[tuple[object, int, tuple[int, ...]]] = []
            for i in range(int(mt.mtmd_input_chunks_size(chunks))):
                chunk = mt.mtmd_input_chunks_get(chunks, i)
                kind = int(mt.mtmd_input_chunk_get_type(chunk))
                tokens: tuple[int, ...] = ()
                if kind == _TEXT:
                    n = ctypes.c_size_t()
                    ptr = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    tokens = tuple(int(ptr[j]) for j in range(n.value))
                elif kind not in _KINDS:
                    raise BackendError(f"mtmd returned a chunk of unknown type {kind}")
                out.append((chunk, kind, tokens))
        except BaseException:
            self._release(chunks, bitmap)
            raise
        return chunks, bitmap, out

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        self._life.close()

    def _free(self) -> None:
        self._drop_held()
        self._mt.mtmd_free(self._ptr)
        self._ptr = None
        self._model.lifetime.release()


def _compute_mib(line: str) -> list[str]:
    """The MiB figure of a "compute buffer size = N MiB" line mtmd logs while loading."""
    marker = "compute buffer size ="
    if marker not in line:
        return []
    rest = line.split(marker, 1)[1].strip().split()
    return rest[:1] if rest and rest[-1].startswith("MiB") else []
