"""Images in prompts on the stub backend: a span per image, decoded whole off a slot like any
other, cached by the image's content (docs/internals.md, "Media spans")."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import LOW_GATES, make_engine, stub_config
from tests.engine.mediakit import image_chat, png

from kvwarm.backends.stub import StubBackend
from kvwarm.backends.stub.projector import StubProjector
from kvwarm.cache.explain import MissReason
from kvwarm.engine.api import Engine, ModelConfig
from kvwarm.engine.prompts import MediaPrompt
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import BackendError, InvalidRequestError
from kvwarm.media import Media, MediaError, MediaLimits
from kvwarm.settings import SERVER_POLICY
from kvwarm.tokens import Prompt, common_prefix

GREEDY = GenerationOptions(max_tokens=8, temperature=0.0)


def media_config(n_parallel: int = 1, **kw: object) -> ModelConfig:
    return replace(stub_config(n_parallel, **kw), mmproj="stub-mmproj.gguf")  # type: ignore[arg-type]


def test_an_image_is_a_span_of_its_content_and_the_reply_depends_on_it(engine: Engine) -> None:
    model = engine.load_model(config=media_config())
    prompt, text = model.chat_prompt(image_chat(png(1), "What is it?"))
    (span,) = prompt.prompt.spans
    assert span.length == 16 and span.kind == "image"
    assert "<__media__>" in text and len(prompt.media) == 1
    a = model.chat(image_chat(png(1), "What is it?"), options=GREEDY)
    b = model.chat(image_chat(png(2), "What is it?"), options=GREEDY)
    assert a.prompt_tokens == prompt.prompt.tokens
    assert a.text != b.text  # the picture reached the model
    again = model.chat(image_chat(png(1), "What is it?"), options=GREEDY)
    assert again.text == a.text and again.stats.cache_hit == "exact"


def test_the_same_image_shares_its_kv_across_conversations_and_a_pixel_does_not(
    engine: Engine,
) -> None:
    model = engine.load_model(config=media_config())
    first = model.chat(image_chat(png(1), "What is it?"), options=GREEDY)
    span = model.chat_prompt(image_chat(png(1), "What is it?"))[0].prompt.spans[0]
    model.evict()  # through the cache, not the slot's live KV
    other = model.chat(image_chat(png(1), "Which colours?"), options=GREEDY)
    assert other.stats.cached_tokens > span.end  # past the picture
    model.evict()
    poked = model.chat(image_chat(png(1, poke=True), "What is it?"), options=GREEDY)
    assert poked.stats.cached_tokens <= span.start  # only what precedes the picture
    assert poked.stats.reuse is not None
    assert poked.stats.reuse.reason is MissReason.MEDIA_DIFFERS  # and says why
    assert first.stats.cached_tokens == 0


def test_a_cold_save_never_ends_inside_a_span() -> None:
    """Capped at 70 tokens, the cold save of this prompt would end at 64, inside the image
    (positions 62 to 78): it moves to the image's start, and no row ends inside the span."""
    engine = make_engine(policy=replace(LOW_GATES, cold_max_tokens=70))
    try:
        model = engine.load_model(config=media_config())
        chat = image_chat(png(3), "Why?")
        (span,) = model.chat_prompt(chat)[0].prompt.spans
        assert span.start < 64 < span.end
        model.chat(chat, options=GREEDY)
        engine.cache.flush()
        lengths = {row.n_tokens for row in engine.cache.rows()}
        assert span.start in lengths, (lengths, span)
        assert not any(span.start < n < span.end for n in lengths), (lengths, span)
    finally:
        engine.close()


def test_an_image_prompt_restores_after_a_restart(tmp_path: Path) -> None:
    chat = image_chat(png(4), "What is it?")
    first_engine = make_engine(tmp_path)
    try:
        model = first_engine.load_model(config=replace(media_config(), save_tier="disk"))
        cold = model.chat(chat, options=GREEDY)
        (span,) = model.chat_prompt(chat)[0].prompt.spans
    finally:
        first_engine.close()
    second_engine = make_engine(tmp_path)
    try:
        backend = StubBackend()
        cfg = replace(media_config(backend=backend), save_tier="disk")
        model = second_engine.load_model(config=cfg)
        warm = model.chat(chat, options=GREEDY)
        assert warm.text == cold.text
        assert warm.stats.cached_tokens >= span.end
        assert model._projector is not None and model._projector.encoded == 0  # type: ignore[attr-defined]
    finally:
        second_engine.close()


def test_other_slots_decode_while_a_span_is_encoded(engine: Engine) -> None:
    backend = StubBackend()
    backend.encode_gate = threading.Event()
    model = engine.load_model(config=media_config(2, backend=backend))
    held = model.stream_chat(image_chat(png(5), "What is it?"), options=GREEDY)
    text = model.complete("A text prompt beside it, long enough. " * 3, GREEDY)
    assert text.completion_tokens and not held.done  # answered while the image waits
    backend.encode_gate.set()
    assert held.result().completion_tokens


def test_no_thread_that_encoded_a_span_outlives_its_encode(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama.cpp's OpenMP keeps a pool of threads for every thread that ran a parallel region
    # until it exits; a long-lived encoder thread's pool outnumbered the 2 CPUs and libgomp
    # then throttled the worker's barriers: every later decode ~1.6x slower (the encoder's
    # docstring). Each encode now runs on a thread that ends with it.
    ran_on: list[threading.Thread] = []
    original = StubProjector.encode

    def encode(self: StubProjector, media: Media, index: int) -> bytes:
        ran_on.append(threading.current_thread())
        return original(self, media, index)

    monkeypatch.setattr(StubProjector, "encode", encode)
    model = engine.load_model(config=media_config())
    for seed in (11, 12):
        assert model.chat(image_chat(png(seed), "What is it?"), options=GREEDY).completion_tokens
    assert len(ran_on) == 2 and ran_on[0] is not ran_on[1]
    assert not any(thread.is_alive() for thread in ran_on)


def test_an_encode_that_fails_fails_its_request_alone(engine: Engine) -> None:
    backend = StubBackend()
    backend.encode_error = "the encoder broke"
    model = engine.load_model(config=media_config(backend=backend))
    with pytest.raises(BackendError, match="the encoder broke"):
        model.chat(image_chat(png(6), "What is it?"), options=GREEDY)
    assert model.complete("And text still works. " * 2, GREEDY).completion_tokens
    assert model.status().active == 0


def test_a_deterministic_restore_of_an_image_prompt_equals_a_cold_run(tmp_path: Path) -> None:
    chat = image_chat(png(7), "What is it? " * 3)
    outs = []
    for _ in range(2):
        eng = make_engine(tmp_path)
        try:
            cfg = media_config(deterministic=True, n_batch=16)
            model = eng.load_model(config=replace(cfg, save_tier="disk"))
            out = model.chat(chat, options=replace(GREEDY, logprobs=1))
            outs.append(out)
        finally:
            eng.close()
    cold, warm = outs
    assert warm.stats.cached_tokens > 0
    assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs


def test_media_is_refused_clearly(engine: Engine) -> None:
    text_only = engine.load_model("plain", config=stub_config())
    with pytest.raises(InvalidRequestError, match="no multimodal projector") as info:
        text_only.chat(image_chat(png(1), "?"), options=GREEDY)
    assert info.value.param == "messages.1.content.1"
    limits = MediaLimits(max_bytes=8192, max_pixels=32 * 32, max_items=1, formats=("png",))
    model = engine.load_model("seeing", config=replace(media_config(), media=limits))
    cases = {
        "not a whole image": png(1, (16, 16))[:-40],  # truncated
        "not an image of an allowed format": b"GIF89a" + bytes(100),
        "above this server's limit of 1024": png(1, (40, 40)),  # pixels
        "above this server's limit of 8192": png(1, (36, 36)) * 4,  # bytes
        "is empty": b"",
    }
    for message, data in cases.items():
        with pytest.raises(MediaError, match=message) as info:
            model.chat(image_chat(data, "?"), options=GREEDY)
        assert info.value.param == "messages.1.content.1", message
    two = image_chat(png(1, (16, 16)), "?")
    two[1]["content"] = [*two[1]["content"], {"type": "image", "image": png(2, (16, 16))}]  # type: ignore[misc]
    with pytest.raises(MediaError, match="at most 1"):
        model.chat(two, options=GREEDY)
    # Per request, whatever each item's own limits: two 16x16 images take 1536 bytes decoded.
    bounded = replace(limits, max_items=2, max_request_bytes=1000)
    narrow = engine.load_model("narrow", config=replace(media_config(), media=bounded))
    with pytest.raises(MediaError, match="media_max_request_bytes") as info:
        narrow.chat(two, options=GREEDY)
    assert info.value.param == "messages.1.content.3"
    with pytest.raises(InvalidRequestError, match="projector reads image"):
        model.chat(
            [{"role": "user", "content": [{"type": "audio", "audio": b"RIFF"}]}], options=GREEDY
        )
    assert model.status().active == 0


def test_after_a_restart_each_conversation_prefills_only_its_new_message(tmp_path: Path) -> None:
    """bench/media.py's load on the stub (issue 36): three conversations about pictures (the
    first and third the same) share one slot; after a restart, each one's next turn restores
    all that its previous turn left (prompt and reply, the picture's span among them) from the
    disk tier and prefills only the new message."""
    system = "You describe pictures. " * 8
    histories = [
        image_chat(png(seed), f"Conversation {c}: what is it?", system=system)
        for c, seed in enumerate((11, 12, 11))
    ]
    left: list[tuple[int, ...]] = [(), (), ()]  # each conversation's last prompt and reply
    for turns in (3, 1):  # then a restart
        engine = make_engine(tmp_path, policy=SERVER_POLICY)  # what kvwarm serve saves
        try:
            model = engine.load_model(config=replace(media_config(), save_tier="disk"))
            for _ in range(turns):
                for c, history in enumerate(histories):
                    if left[c]:
                        history.append({"role": "user", "content": f"And then? ({c})"})
                    prompt = model.chat_prompt(history)[0].prompt
                    out = model.chat(history, options=GREEDY)
                    history.append({"role": "assistant", "content": out.text})
                    if turns == 1:
                        # (A reply's last token is sampled, never decoded: no KV holds it.)
                        said = common_prefix(left[c][:-1], prompt.tokens)
                        assert prompt.spans[0].end < said < len(prompt.tokens), (c, said)
                        assert out.stats.cached_tokens == said, (c, out.stats)
                    left[c] = out.tokens
        finally:
            engine.close()


def test_a_prefill_after_an_image_is_the_chat_prompt_then_its_text(engine: Engine) -> None:
    """``chat(prefill=)``: the chat's prompt, its picture's span kept, then the prefill as
    plain text (special-token text in it stays text); and the reply continues from there."""
    model = engine.load_model(config=media_config())
    chat = image_chat(png(10), "What is it?")
    prompt, _ = model.chat_prompt(chat)
    prefill = "It is <|user|> a"
    tail = model.tokenize(prefill, add_special=False, parse_special=False)
    out = model.chat(chat, options=GREEDY, prefill=prefill)
    assert out.prompt_tokens == (*prompt.prompt.tokens, *tail)
    assert model.count_chat_tokens(chat, prefill=prefill) == len(out.prompt_tokens)
    same = model.complete(prompt.extended(tail), GREEDY)
    assert same.text == out.text and same.stats.cached_tokens > prompt.prompt.spans[0].end


def test_a_media_prompt_whose_spans_do_not_name_its_media_is_refused(engine: Engine) -> None:
    """A span's ids are the cache's name for its content: a ``MediaPrompt`` whose span names
    one picture while carrying another's pixels was decoded and saved, and a later chat
    showing the first picture restored the second one's KV. Refused now, whatever part
    disagrees: the digest, the ids, the length the projector's layout gives."""
    model = engine.load_model(config=media_config())
    a, _ = model.chat_prompt(image_chat(png(1), "What is it?"))
    b, _ = model.chat_prompt(image_chat(png(2), "What is it?"))
    (span,) = a.prompt.spans
    opts = replace(GREEDY, max_tokens=2)
    tokens = list(a.prompt.tokens)
    tokens[span.end - 1] = 5  # a text id inside the span
    short = Prompt.build(
        [a.prompt.tokens[: span.start], (span.digest, span.length - 1, "image"), [5, 6]]
    )
    forged = {
        "names another image": MediaPrompt(a.prompt, b.media),
        "do not hold its span ids": MediaPrompt(Prompt(tuple(tokens), a.prompt.spans), a.media),
        "has 15 positions; this model's projector lays that image out in 16": MediaPrompt(
            short, a.media
        ),
    }
    for needle, prompt in forged.items():
        with pytest.raises(InvalidRequestError, match=needle) as info:
            model.complete(prompt, options=opts)
        assert info.value.param == "prompt"
    honest = model.complete(a, options=opts)
    again = model.chat(image_chat(png(1), "What is it?"), options=opts)
    assert again.tokens == honest.tokens and again.stats.cache_hit == "exact"
    assert model.complete(a.extended([5, 6]), options=opts).stats.cached_tokens >= span.end


def test_a_cancelled_request_leaves_no_encode_behind(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encodes run one at a time, in order: a request cancelled (a client gone) while its
    first picture was being encoded left its others queued, and they were encoded for
    nobody while every later request's pictures waited behind them (seconds each on a CPU)."""
    backend = StubBackend()
    backend.encode_gate = threading.Event()
    started = threading.Event()
    original = StubProjector.encode

    def encode(self: StubProjector, media: Media, index: int) -> bytes:
        started.set()
        return original(self, media, index)

    monkeypatch.setattr(StubProjector, "encode", encode)
    model = engine.load_model(config=media_config(backend=backend))
    chat = image_chat(png(21), "What is it?")
    more = [{"type": "image", "image": png(seed)} for seed in (22, 23, 24)]
    chat[1]["content"] = [*chat[1]["content"], *more]  # type: ignore[misc]
    held = model.stream_chat(chat, options=GREEDY)
    assert started.wait(30)  # admitted: its four encodes are queued, the first one running
    held.cancel()
    assert held.result().stats.finish_reason == "cancelled"
    backend.encode_gate.set()
    # Encodes run in order: this one's ends after whatever the cancelled request left.
    assert model.chat(image_chat(png(25), "What is it?"), options=GREEDY).completion_tokens
    assert model._projector.encoded == 2  # type: ignore[union-attr]


def test_a_media_prompt_carrying_a_clip_at_another_rate_is_refused(engine: Engine) -> None:
    """mtmd takes a clip's samples without their rate: it reads them at its own (16 kHz for
    Whisper), so a ``MediaPrompt`` whose clip was at 8 kHz was decoded as a clip twice as
    long at half the pitch, and its KV saved under that clip's name. Chats resample every
    clip to the projector's rate (``load_media``); a prompt a caller builds is refused."""
    import numpy as np

    from kvwarm.engine.prompts import SpanMedia, span_digest
    from kvwarm.media import Audio

    model = engine.load_model(config=replace(media_config(), mmproj="stub-audio-mmproj.gguf"))
    projector = model._projector
    assert projector is not None and projector.facts.audio_sample_rate == 16000
    tone = np.sin(np.arange(8000) / 5).astype("<f4").tobytes()
    opts = replace(GREEDY, max_tokens=2)
    for rate, refused in ((8000, True), (16000, False)):
        clip = Audio(tone, rate)
        pieces = projector.layout(clip)
        parts: list[object] = [[1, 2, 3]]
        for piece in pieces:
            if isinstance(piece, tuple):
                parts.append(list(piece))
            else:
                parts.append((span_digest(clip, 0), piece.n_tokens, "audio"))
        prompt = MediaPrompt(Prompt.build(parts), (SpanMedia(clip),))  # type: ignore[arg-type]
        if refused:
            with pytest.raises(InvalidRequestError, match="8000 Hz") as info:
                model.complete(prompt, options=opts)
            assert info.value.param == "prompt"
        else:
            assert model.complete(prompt, options=opts).stats.prompt_tokens == len(prompt.prompt)
