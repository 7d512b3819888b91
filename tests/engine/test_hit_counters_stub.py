"""The cache's request counters on the stub engine (found by review): each request counts
exactly one outcome (``counters.REQUEST_OUTCOMES``), for what served its prompt's prefix once
it was in its slot, never for what a lookup found: a row restored (``hits_exact``,
``hits_longest_prefix``, ``hits_resume``), a slot's live KV (``hits_live``), or nothing
(``misses``, a refused or failed restore included); a request that failed before it was
seated counts ``admission_failures``. Lookups, metadata reads and waits count nothing. Each
row restore is also counted for the tier it came from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tests.engine.conftest import LOW_GATES, GatedBackend, make_engine, stub_config

from kvwarm.cache.counters import REQUEST_OUTCOMES
from kvwarm.cache.types import CacheConfig, Namespace, PrefixMatch, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.errors import BackendError, StateRestoreError

GREEDY = GenerationOptions(max_tokens=6, temperature=0.0)
PROMPT = "The system prompt says: be brief and kind. Question: what is a cache?"


def outcomes(engine: Engine) -> dict[str, float]:
    counters = engine.cache.counters()
    return {name: counters[name] for name in REQUEST_OUTCOMES}


def changed(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """The outcome counters that moved, and by how much."""
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def counted(engine: Engine, model: Model, prompt: object, opts: GenerationOptions = GREEDY,
            **kw: object) -> tuple[Completion, dict[str, float]]:  # fmt: skip
    """A request's completion and what it counted (its saves flushed after)."""
    before = outcomes(engine)
    out = model.complete(prompt, opts, **kw)  # type: ignore[arg-type]
    engine.cache.flush()
    return out, changed(before, outcomes(engine))


def test_a_cold_request_is_one_miss_and_the_same_prompt_again_one_exact_hit(
    engine: Engine,
) -> None:
    model = engine.load_model(config=stub_config())
    first, delta = counted(engine, model, PROMPT)
    assert first.stats.cache_hit == "cold" and delta == {"misses": 1}
    model.evict()  # only the cache can serve it now
    before_restores = engine.cache.counters()["latency_restore_count"]
    again, delta = counted(engine, model, PROMPT)
    assert again.stats.cache_hit == "exact"
    # One hit, of the row holding the whole prompt. The lookup counted hits_longest_prefix
    # before, whichever row then served.
    assert delta == {"hits_exact": 1}
    assert engine.cache.counters()["latency_restore_count"] == before_restores + 1


def test_a_prewarmed_prompt_restored_with_its_logits_is_one_hit(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    tokens = model.tokenize(PROMPT)
    before = outcomes(engine)
    model.prewarm(tokens)  # a row of exactly the prompt
    engine.cache.flush()
    # The cache's upkeep, not a request: no outcome (it counted a miss, and keep-alive's
    # re-warms a hit each, before), counted as the model's prewarm instead.
    assert changed(before, outcomes(engine)) == {}
    status = model.status()
    assert (status.requests, status.prewarms) == (0, 1)
    assert status.prewarm_prompt_tokens == status.prewarm_prefilled_tokens == len(tokens)
    model.evict()
    out, delta = counted(engine, model, tokens)
    assert out.stats.cache_hit == "exact" and out.stats.cached_tokens == len(tokens)
    assert delta == {"hits_exact": 1}


def test_an_exact_row_found_beside_a_longer_one_is_one_hit(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup names a longer row sharing the whole prompt (the fewest bytes: a large
    vocabulary's logits make the prompt's own row the bigger), and the worker then reads the
    row of exactly the prompt for its logits: one request, one hit. It counted
    ``hits_longest_prefix`` and ``hits_exact`` both before."""
    model = engine.load_model(config=stub_config())
    first, _ = counted(engine, model, PROMPT)  # a row of the prompt and its reply
    tokens = first.prompt_tokens
    model.prewarm(tokens)  # a row of exactly the prompt, with its logits
    engine.cache.flush()
    model.evict()
    cache = engine.cache
    (longer,) = [r for r in cache.rows() if r.n_tokens > len(tokens)]
    original = cache.longest_prefix

    def names_the_longer(ns: Namespace, prompt: Sequence[int], **kw: Any) -> PrefixMatch | None:
        match = original(ns, prompt, **kw)
        return PrefixMatch(longer, len(prompt)) if match is not None else None

    monkeypatch.setattr(cache, "longest_prefix", names_the_longer)
    out, delta = counted(engine, model, tokens)
    assert out.stats.cache_hit == "exact" and out.stats.cached_tokens == len(tokens)
    assert delta == {"hits_exact": 1}


def test_a_follow_up_turn_counts_one_hit_of_its_kind(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    first, _ = counted(engine, model, PROMPT)
    assert first.stats.key is not None
    follow = [*first.tokens, *model.tokenize(" ok?", add_special=False)]
    # Naming the previous turn: its row restored is a resume, and only that. Before, the
    # parent_key's wait or a row's metadata read could count another.
    model.evict()
    out, delta = counted(engine, model, follow, parent_key=first.stats.key)
    assert out.stats.cache_hit == "partial" and out.stats.cached_tokens >= len(first.tokens) - 1
    assert delta == {"hits_resume": 1}
    # The same turn sent statelessly: a row holding part of the prompt.
    model.evict()
    out, delta = counted(engine, model, [*follow, *model.tokenize(" yes", add_special=False)])
    assert out.stats.cache_hit == "partial"
    assert delta == {"hits_longest_prefix": 1}


def test_a_slots_live_kv_is_a_live_hit_not_a_row_restore(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    counted(engine, model, PROMPT)
    assert engine.cache.rows()  # a row could serve the next prompt too
    restores = engine.cache.counters()["latency_restore_count"]
    # The slot still holds the KV: kept, nothing read from the cache. The lookup found the
    # row and counted it as a hit before.
    out, delta = counted(engine, model, PROMPT + " And a follow-up.")
    assert out.stats.cache_hit == "partial"
    assert delta == {"hits_live": 1}
    # The same prompt again, served by live KV (the row's logits at most).
    out, delta = counted(engine, model, PROMPT + " And a follow-up.")
    assert out.stats.cache_hit == "exact" and delta == {"hits_live": 1}
    # A follow-up naming its previous turn, still in the slot: live, not a resume.
    assert out.stats.key is not None
    follow = [*out.tokens, *model.tokenize(" ok?", add_special=False)]
    _, delta = counted(engine, model, follow, parent_key=out.stats.key)
    assert delta == {"hits_live": 1}
    assert engine.cache.counters()["latency_restore_count"] == restores


def test_another_slots_live_kv_copied_is_a_live_hit() -> None:
    """While one request generates, another with its prompt copies its live KV (``seq_cp``)
    though a row of that prompt is in the cache too."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        backend.gate.set()
        model.complete(PROMPT, GREEDY)  # rows of the prompt
        eng.cache.flush()
        backend.gate.clear()
        slots = model._worker.rt.slots
        long = GenerationOptions(max_tokens=40, temperature=0.0, ignore_eos=True)
        other = " and something else entirely, to fill the other slot"
        busy = model.stream(PROMPT + other, long)
        for _ in range(50):  # its prefill's passes; each step leaves the worker parked
            if any(s.phase == "generate" for s in slots):
                break
            backend.gate.step()
        assert any(s.phase == "generate" for s in slots)
        before = outcomes(eng)
        copied = model.stream(PROMPT + other + " and more", GREEDY)
        backend.gate.set()
        busy.result()
        assert copied.result().stats.cache_hit == "partial"
        assert changed(before, outcomes(eng)) == {"hits_live": 1}
    finally:
        eng.close()


def test_a_refused_restore_is_a_miss_not_a_hit(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    counted(engine, model, PROMPT)
    model.evict()
    ctx = model._worker.rt.ctx

    def refuse(*args: object) -> int:
        raise StateRestoreError("refused on purpose")

    ctx.kv_unpack = refuse  # type: ignore[method-assign]
    ctx.kv_unpack_chunks = refuse  # type: ignore[method-assign]
    out, delta = counted(engine, model, PROMPT + " More.")
    assert out.stats.cached_tokens == 0 and out.stats.cache_hit == "cold"
    # The lookup's hit was counted before, and then a miss too.
    assert delta == {"misses": 1}


def test_a_row_gone_before_its_read_is_a_miss(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    counted(engine, model, PROMPT)
    model.evict()
    cache = engine.cache
    original = cache.open_row

    def gone_first(key: bytes, **kw: int) -> object:
        cache.delete(key)  # the row leaves after the lookup found it
        return original(key, **kw)  # type: ignore[arg-type]

    cache.open_row = gone_first  # type: ignore[method-assign,assignment]
    try:
        out, delta = counted(engine, model, PROMPT + " More.")
    finally:
        cache.open_row = original  # type: ignore[method-assign]
    assert out.stats.cached_tokens == 0
    assert delta == {"misses": 1}


def test_prompt_logprobs_reuse_nothing_and_count_one_miss(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    counted(engine, model, PROMPT)
    model.evict()
    out, delta = counted(engine, model, PROMPT, replace(GREEDY, prompt_logprobs=0))
    assert out.stats.cached_tokens == 0
    assert delta == {"misses": 1}  # the lookup's row counted as a hit too, before


def test_lookups_reads_and_waits_count_nothing(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    first, _ = counted(engine, model, PROMPT)
    assert first.stats.key is not None
    cache = engine.cache
    before = cache.counters()
    ns = cache.rows()[0].namespace
    key = first.stats.key
    assert cache.lookup_exact(key) is not None
    assert cache.lookup_exact_or_wait(key, 1.0) is not None
    assert cache.settled(key, 1.0) and cache.has(key)
    assert cache.longest_prefix(ns, first.tokens) is not None
    assert cache.whole_prefixes(ns, first.tokens)
    after = cache.counters()
    assert {k: after[k] for k in after if k.startswith(("hits_", "misses"))} == {
        k: before[k] for k in before if k.startswith(("hits_", "misses"))
    }


def test_every_request_counts_exactly_one_outcome(engine: Engine) -> None:
    """A mixed run: the outcome counters add up to the requests made."""
    model = engine.load_model(config=stub_config(n_parallel=2))
    before = outcomes(engine)
    prompts = [PROMPT, PROMPT, PROMPT + " More.", "Entirely different words.", PROMPT, PROMPT]
    for i, prompt in enumerate(prompts):
        # The last one asks for its prompt's logprobs: it reuses nothing it found.
        opts = replace(GREEDY, prompt_logprobs=0) if i == len(prompts) - 1 else GREEDY
        model.complete(prompt, opts)
        if i % 2:
            engine.cache.flush()
            model.evict()
    after = outcomes(engine)
    assert sum(changed(before, after).values()) == len(prompts)


def test_a_request_failing_before_it_is_seated_counts_one_admission_failure(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a request whose admission failed before it was seated (here its
    sampler refused) was answered with the error and counted no outcome, so the outcomes no
    longer added up to the requests. It counts ``admission_failures``: it was never served,
    so it is neither a hit nor a miss."""
    model = engine.load_model(config=stub_config())
    counted(engine, model, PROMPT)
    rt = model._worker.rt

    def refuse(params: object) -> object:
        raise BackendError("sampler refused on purpose")

    monkeypatch.setattr(rt.model, "new_sampler", refuse)
    before = outcomes(engine)
    with pytest.raises(BackendError, match="on purpose"):
        model.complete(PROMPT + " Again.", GREEDY)
    assert changed(before, outcomes(engine)) == {"admission_failures": 1}
    monkeypatch.undo()
    # The worker and its slot are fine: the next request is served and counted as usual.
    _, delta = counted(engine, model, PROMPT + " Again.")
    assert sum(delta.values()) == 1 and "admission_failures" not in delta


def test_a_request_failing_once_seated_counts_its_outcome_once(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after its outcome was counted (its checkpoints cannot be planned) fails the
    request, and counts no admission failure on top of the outcome."""
    model = engine.load_model(config=stub_config())
    port = model._worker.port

    def broken(*args: object, **kw: object) -> object:
        raise BackendError("no checkpoints on purpose")

    monkeypatch.setattr(port, "saved_below", broken)
    before = outcomes(engine)
    with pytest.raises(BackendError, match="on purpose"):
        model.complete(PROMPT, GREEDY)
    assert changed(before, outcomes(engine)) == {"misses": 1}


def test_each_restore_is_counted_for_the_tier_it_came_from(tmp_path: Path) -> None:
    """Per-tier restores (found by review: an operator could not see how many restores each
    tier served, nor how long they took; a tier's ``hits`` count its rows opened, which LFU
    reads): ``tier_<name>_restores``, ``_restored_bytes`` and ``_restore_seconds``, the
    ``restore`` latency split by tier. A slot's live KV restores nothing."""
    eng = Engine(
        EngineConfig(
            cache=CacheConfig(
                tiers=(TierConfig("ram", 64 << 20), TierConfig("disk", 64 << 20, tmp_path))
            ),
            policy=LOW_GATES,
        )
    )
    try:
        on_disk = eng.load_model(config=replace(stub_config(), save_tier="disk"))
        in_ram = eng.load_model(model_id="ram-model", config=stub_config())

        zero = eng.cache.counters()
        assert zero["tier_ram_restores"] == zero["tier_disk_restores"] == 0  # listed at 0
        # One model's rows go to disk, the other's to RAM (the same stub: other prompts).
        other = "Entirely different words, for a row of their own in RAM."
        for model, prompt in ((on_disk, PROMPT), (in_ram, other)):
            counted(eng, model, prompt)
            model.evict()
        before = eng.cache.counters()
        _, delta = counted(eng, on_disk, PROMPT)
        assert delta == {"hits_exact": 1}
        after = eng.cache.counters()
        assert after["tier_disk_restores"] - before["tier_disk_restores"] == 1
        assert after["tier_ram_restores"] == before["tier_ram_restores"]
        assert after["tier_disk_restored_bytes"] > before["tier_disk_restored_bytes"]
        assert after["tier_disk_restore_seconds"] > before["tier_disk_restore_seconds"]
        _, delta = counted(eng, in_ram, other)
        assert delta == {"hits_exact": 1}
        final = eng.cache.counters()
        assert final["tier_ram_restores"] - after["tier_ram_restores"] == 1
        # The restore latency is their sum; live KV (the slot kept it) adds to neither.
        _, delta = counted(eng, in_ram, other + " More.")
        assert delta == {"hits_live": 1}
        last = eng.cache.counters()
        for key in ("count", "seconds"):
            series = "restores" if key == "count" else "restore_seconds"
            split = sum(last[f"tier_{t}_{series}"] for t in ("ram", "disk"))
            assert split == pytest.approx(last[f"latency_restore_{key}"])
        assert last["tier_ram_restores"] == final["tier_ram_restores"]
        # A tier's hits (rows opened, for LFU) are another count, and stay what they were.
        assert sum(r.hits for r in eng.cache.rows() if r.tier == "disk") >= 1
    finally:
        eng.close()
