"""Cache salts on the stub: requests share rows and live KV only when they share a salt, so
``cached_tokens`` never tells one tenant what another's prompt begins with."""

from __future__ import annotations

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.cache.formats.key import salted_namespace
from kvwarm.engine.api import Engine
from kvwarm.engine.model import Model
from kvwarm.engine.types import MAX_CACHE_SALT_CHARS, Completion, GenerationOptions
from kvwarm.errors import InvalidRequestError

GREEDY = GenerationOptions(max_tokens=8, temperature=0.0)
PROMPT = "The system prompt says: be brief and kind. Question: what is a cache?"


def run(model: Model, prompt: str | list[int], salt: str | None, **kw: object) -> Completion:
    return model.complete(prompt, GREEDY, cache_salt=salt, **kw)  # type: ignore[arg-type]


def test_a_salted_prompt_is_cold_for_other_salts_and_warm_for_its_own(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    first = run(model, PROMPT, "alice")
    assert first.stats.cached_tokens == 0
    for salt in ("bob", None, "alice "):
        engine.cache.flush()
        model.evict()  # only rows could help now; they must all be of another namespace
        other = run(model, PROMPT, salt)
        assert other.stats.cache_hit == "cold", salt
        assert other.stats.cached_tokens == 0, salt
    engine.cache.flush()
    model.evict()
    again = run(model, PROMPT, "alice")
    assert again.stats.cache_hit == "exact"
    assert again.stats.cached_tokens >= again.stats.prompt_tokens - 1
    assert again.text == first.text


def test_salted_rows_live_in_the_salted_namespace_only(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    run(model, PROMPT, "alice")
    engine.cache.flush()
    plain = model.namespace()
    salted = salted_namespace(plain, b"alice")
    assert salted != plain and salted.fingerprint == plain.fingerprint
    rows = engine.cache.rows()
    assert rows and {r.namespace for r in rows} == {salted}
    assert engine.cache.rows(plain) == []


def test_idle_slot_kv_is_never_reused_across_salts(engine: Engine) -> None:
    """The ``self`` and ``copy`` candidates both come from an idle slot holding another salt's
    KV; with no row to restore, only live KV could give ``cached_tokens``."""
    model = engine.load_model(config=stub_config(n_parallel=2))
    run(model, PROMPT, "alice")
    engine.cache.flush()
    for row in engine.cache.rows():
        engine.cache.delete(row.key)
    bob = run(model, PROMPT + " Go on.", "bob")
    assert bob.stats.cached_tokens == 0 and bob.stats.cache_hit == "cold"
    # Alice's live KV is still there for Alice (the salt gates reuse, it loses nothing).
    for row in engine.cache.rows():
        engine.cache.delete(row.key)
    alice = run(model, PROMPT + " Go on.", "alice")
    assert alice.stats.cached_tokens >= len(model.tokenize(PROMPT)) - 1


def test_a_busy_slot_is_copied_only_into_its_own_salt() -> None:
    """While Alice generates, Bob and Carol (Alice's salt) ask for the same prompt: Carol
    reuses Alice's live KV (``seq_cp``), Bob gets none of it."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=3, backend=backend))  # type: ignore[arg-type]
        slots = model._worker.rt.slots
        long = GenerationOptions(max_tokens=40, temperature=0.0, ignore_eos=True)
        alice = model.stream(PROMPT, long, cache_salt="alice")
        for _ in range(50):  # the prefill's passes; each step leaves the worker parked
            if any(s.phase == "generate" for s in slots):
                break
            backend.gate.step()
        assert any(s.phase == "generate" for s in slots)
        # Nothing in the cache can help Bob or Carol: only Alice's live KV.
        eng.cache.flush()
        for row in eng.cache.rows():
            eng.cache.delete(row.key)
        bob = model.stream(PROMPT, GREEDY, cache_salt="bob")
        carol = model.stream(PROMPT, GREEDY, cache_salt="alice")
        backend.gate.set()
        got_bob, got_carol = bob.result(), carol.result()
        alice.result()
        assert got_bob.stats.cached_tokens == 0
        assert got_carol.stats.cached_tokens >= got_carol.stats.prompt_tokens - 1
        assert got_carol.text == got_bob.text  # same prompt, greedy: only the reuse differs
    finally:
        eng.close()


def test_parent_key_of_another_salt_does_not_restore(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    first = run(model, PROMPT, "alice")
    assert first.stats.key is not None
    follow = list(first.tokens) + model.tokenize(" ok?", add_special=False)
    engine.cache.flush()
    model.evict()
    bob = run(model, follow, "bob", parent_key=first.stats.key)
    assert bob.stats.cached_tokens == 0
    model.evict()
    alice = run(model, follow, "alice", parent_key=first.stats.key)
    assert alice.stats.cached_tokens >= len(first.tokens) - 1


def test_evict_saves_a_salted_slot_under_its_own_salt(engine: Engine) -> None:
    """An idle slot's KV saved on evict keeps its salt: saved under the model's plain
    namespace it would serve every tenant."""
    model = engine.load_model(config=stub_config())
    run(model, PROMPT, "alice")
    engine.cache.flush()
    for row in engine.cache.rows():  # the live KV is now the only copy
        engine.cache.delete(row.key)
    assert model.evict() == 1
    engine.cache.flush()
    assert engine.cache.rows(model.namespace()) == []
    plain = run(model, PROMPT, None)
    assert plain.stats.cached_tokens == 0
    model.evict()
    alice = run(model, PROMPT, "alice")
    assert alice.stats.cache_hit == "exact"


def test_prewarm_with_a_salt_warms_that_salt_only(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    stats = model.prewarm(PROMPT, cache_salt="alice")
    assert stats.key is not None
    engine.cache.flush()
    model.evict()
    assert run(model, PROMPT, "bob").stats.cached_tokens == 0
    model.evict()
    assert run(model, PROMPT, "alice").stats.cache_hit == "exact"


def test_chat_and_stream_take_the_salt(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    messages = [{"role": "user", "content": "Tell me about caches, briefly please."}]
    model.chat(messages, options=GREEDY, cache_salt="alice")
    engine.cache.flush()
    model.evict()
    bob = model.stream_chat(messages, options=GREEDY, cache_salt="bob").result()
    assert bob.stats.cached_tokens == 0
    model.evict()
    alice = model.stream_chat(messages, options=GREEDY, cache_salt="alice").result()
    assert alice.stats.cached_tokens > 0


@pytest.mark.parametrize(
    "salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), "bad \ud800 salt", b"bytes", 7]
)
def test_bad_salts_are_refused_before_anything_runs(engine: Engine, salt: object) -> None:
    model = engine.load_model(config=stub_config())
    with pytest.raises(InvalidRequestError) as err:
        model.complete(PROMPT, GREEDY, cache_salt=salt)  # type: ignore[arg-type]
    assert err.value.param == "cache_salt"
    with pytest.raises(InvalidRequestError):
        model.prewarm(PROMPT, cache_salt=salt)  # type: ignore[arg-type]
    assert model.status().requests == 0


def test_longest_salt_is_accepted(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    out = run(model, PROMPT, "\u00e9" * MAX_CACHE_SALT_CHARS)
    assert out.stats.completion_tokens > 0
