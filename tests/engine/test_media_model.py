"""Images in prompts on llama.cpp: SmolLM2 and Gemma 3 270M with the tiny random-weight projector
``tests/tinymodels.py`` writes. The output means nothing; the mechanics do: kvwarm's greedy
reply equals llama-server ``--mmproj``'s on the same files (recorded in
``tests/fixtures/media_reference.<vector set>.json`` by ``tests/media_reference.py``), and an
image's KV is shared, restored after a restart and bit-identical to a cold run's in
deterministic mode."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tests import media_reference as ref
from tests import references
from tests.engine.conftest import make_engine
from tests.engine.mediakit import poke
from tests.tinymodels import PROJ_TOKENS, write_tiny_audio_projector, write_tiny_projector

from kvwarm.backends import get_backend
from kvwarm.backends.base import ContextParams, MediaSpan, ProjectorParams
from kvwarm.engine.api import Engine, ModelConfig
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import InvalidRequestError, MediaError, ModelLoadError
from kvwarm.media import Audio

pytestmark = pytest.mark.model

FIXTURE = references.load(ref.FIXTURE)
GREEDY = GenerationOptions(max_tokens=ref.MAX_TOKENS, temperature=0.0)


def config(proj: Path, template: Path | None = None, **context: object) -> ModelConfig:
    # As llama-server runs it: each text piece and the picture in one pass each.
    params = ContextParams(n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, n_threads_batch=1)
    return ModelConfig(
        context=replace(params, flash_attn="on", **context),  # type: ignore[arg-type]
        mmproj=str(proj),
        chat_template=None if template is None else str(template),
    )


@pytest.fixture(scope="module")
def projectors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case's projector, checked to be the very file the reference was recorded with."""
    out = {}
    for case, width in ref.CASES:
        path = write_tiny_projector(tmp_path_factory.mktemp(case) / f"mmproj-{case}.gguf", width)
        assert ref.sha256(path.read_bytes()) == FIXTURE["cases"][case]["mmproj_sha256"], path
        out[case] = path
    return out


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = make_engine(tmp_path)
    yield eng
    eng.close()


@pytest.mark.parametrize("case", [c for c, _ in ref.CASES])
def test_the_greedy_reply_to_a_picture_equals_llama_servers(
    case: str, projectors: dict[str, Path], engine: Engine, request: pytest.FixtureRequest
) -> None:
    expected = FIXTURE["cases"][case]
    gemma = case == "gemma"
    path = Path(request.getfixturevalue("gemma_path")) if gemma else ref.model_path(case)
    assert path.name == expected["model"]
    model = engine.load_model(str(path), config=config(projectors[case], ref.TEMPLATES[case]))
    info = model.info()
    assert info.media == ("image",) and info.projector_bytes > 0
    for seed, reply in expected["replies"].items():
        png = ref.picture(int(seed))
        assert ref.sha256(png) == reply["png_sha256"]
        out = model.chat(ref.messages(png), options=GREEDY)
        assert out.stats.prompt_tokens == reply["prompt_tokens"], seed
        assert out.text == reply["text"], (case, seed)


def test_an_image_is_shared_restored_after_a_restart_and_exact(
    projectors: dict[str, Path], tmp_path: Path
) -> None:
    """SmolLM2: the same picture in another conversation reuses its KV past the picture; a
    one-pixel change reuses only what precedes it; a new engine over the same disk tier
    restores the picture, deterministically equal to the cold run."""
    proj = projectors["smollm2"]
    # Deterministic: reuse stops at multiples of n_batch outside the picture (16 and 48 here).
    cfg = replace(config(proj, n_batch=16, n_ubatch=16), deterministic=True, save_tier="disk")
    png = ref.picture(1)
    opts = replace(GREEDY, max_tokens=4, logprobs=2)
    first = make_engine(tmp_path)
    try:
        model = first.load_model(config=cfg)
        prompt, _ = model.chat_prompt(ref.messages(png))
        (span,) = prompt.prompt.spans
        assert span.length == PROJ_TOKENS
        cold = model.chat(ref.messages(png), options=opts)
        other = ref.messages(png)
        other[1]["content"].append({"type": "text", "text": " Name its colours."})  # type: ignore[union-attr]
        model.evict()  # through the cache, not the slot's live KV
        shared = model.chat(other, options=opts)
        assert shared.stats.cached_tokens >= span.end, shared.stats
        model.evict()
        changed = model.chat(ref.messages(poke(png)), options=opts)
        assert 0 < changed.stats.cached_tokens <= span.start, changed.stats
    finally:
        first.close()
    second = make_engine(tmp_path)
    try:
        model = second.load_model(config=cfg)
        warm = model.chat(ref.messages(png), options=opts)
        assert warm.stats.cached_tokens >= span.end
        assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    finally:
        second.close()


@pytest.mark.slow
def test_the_greedy_reply_to_a_clip_equals_llama_servers(tmp_path: Path, engine: Engine) -> None:
    """The audio path end to end: a WAV clip decoded in Python (16-bit PCM to float32, as
    llama.cpp's own loader reads it) is one causal 750-position span; the reply equals
    llama-server's on the same files."""
    expected = FIXTURE["cases"][ref.AUDIO_CASE]
    proj = write_tiny_audio_projector(tmp_path / "mmproj-audio.gguf", 576)
    assert ref.sha256(proj.read_bytes()) == expected["mmproj_sha256"]
    cfg = config(proj, n_ctx=2048, n_batch=1024, n_ubatch=1024)
    model = engine.load_model(str(ref.model_path("smollm2")), config=cfg)
    assert model.info().media == ("audio",)
    for seed, reply in expected["replies"].items():
        wav = ref.clip(int(seed))
        assert ref.sha256(wav) == reply["wav_sha256"]
        out = model.chat(ref.audio_messages(wav), options=GREEDY)
        assert out.stats.prompt_tokens == reply["prompt_tokens"], seed
        assert out.text == reply["text"], seed
    with pytest.raises(InvalidRequestError, match="reads audio, not image"):
        model.chat(ref.messages(ref.picture(1)), options=GREEDY)


def test_a_projector_for_another_model_is_refused_at_load(
    projectors: dict[str, Path], engine: Engine
) -> None:
    """Gemma's 640-wide projector on SmolLM2 (576): refused before any request."""
    with pytest.raises(ModelLoadError):
        engine.load_model(config=config(projectors["gemma"]))


def test_audio_mtmd_cannot_take_is_a_media_error_never_an_abort(
    tmp_path: Path, engine: Engine
) -> None:
    """A clip of one sample reached ``GGML_ASSERT(buf.size() > sizeof(float))`` in
    mtmd_tokenize and aborted the process; float samples of 1e30 (finite) gave NaN embeddings
    and a reply of nothing real. Both are refused (the projector's own checks, under the
    decoder's), and the model goes on serving."""
    proj = write_tiny_audio_projector(tmp_path / "mmproj-audio.gguf", 576)
    bmodel = get_backend("llama_cpp").load_model(str(ref.model_path("smollm2")))
    try:
        projector = bmodel.load_projector(str(proj), ProjectorParams(1, False))
        try:
            one = Audio(bytes(4), 16000)
            with pytest.raises(MediaError, match="too short"):
                projector.layout(one)
            with pytest.raises(MediaError, match="too short"):
                projector.encode(one, 0)
            loud = Audio(np.full(1600, 1e30, "<f4").tobytes(), 16000)
            with pytest.raises(MediaError, match="not finite"):
                projector.encode(loud, 0)
        finally:
            projector.close()
    finally:
        bmodel.close()
    cfg = config(proj, n_ctx=2048, n_batch=1024, n_ubatch=1024)
    model = engine.load_model(str(ref.model_path("smollm2")), config=cfg)
    clip = [{"role": "user", "content": [{"type": "audio", "audio": loud}]}]
    with pytest.raises(MediaError, match="embeddings of this audio are not finite"):
        model.chat(clip, options=replace(GREEDY, max_tokens=1))
    assert model.status().active == 0
    assert model.complete("Hello", options=replace(GREEDY, max_tokens=1)).stats.prompt_tokens


def test_a_clip_of_many_windows_is_tokenized_once_for_all_its_spans(tmp_path: Path) -> None:
    """mtmd splits a clip into 30 s windows, a span each, encoded one at a time. Found by
    review: each span's encode tokenized the whole clip again (its mel spectrogram, all
    windows), so a clip of N windows was preprocessed N times, quadratic in its length (a
    300 s clip: 11 encodes of 1.4 s each on the tiny projector, nearly all of it the whole
    clip's spectrogram). The tokenized clip is now held across its spans' encodes, and the
    embeddings are those a fresh tokenization gives."""
    proj = write_tiny_audio_projector(tmp_path / "mmproj-audio.gguf", 576)
    bmodel = get_backend("llama_cpp").load_model(str(ref.model_path("smollm2")))
    try:
        projector = bmodel.load_projector(str(proj), ProjectorParams(1, False))
        try:
            rng = np.random.default_rng(5)
            clip = Audio(rng.uniform(-0.5, 0.5, 61 * 16000).astype("<f4").tobytes(), 16000)
            other = Audio(rng.uniform(-0.5, 0.5, 16000).astype("<f4").tobytes(), 16000)
            n_spans = sum(isinstance(p, MediaSpan) for p in projector.layout(clip))
            assert n_spans == 3
            mt = projector._mt  # type: ignore[attr-defined]
            calls: list[int] = []

            class Counting:
                def __getattr__(self, name: str) -> object:
                    return getattr(mt, name)

                def mtmd_tokenize(self, *args: object) -> object:
                    calls.append(1)
                    return mt.mtmd_tokenize(*args)

            projector._mt = Counting()  # type: ignore[attr-defined]
            embeddings = [projector.encode(clip, i) for i in range(n_spans)]
            assert len(calls) == 1
            projector.encode(other, 0)  # another medium: tokenized anew
            assert len(calls) == 2
            again = projector.encode(clip, 1)
            assert len(calls) == 3 and again == embeddings[1]
        finally:
            projector.close()
    finally:
        bmodel.close()
