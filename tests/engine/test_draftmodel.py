"""The draft model's context (engine/worker/draftmodel.py) on the stub, whose KV cells chain by
hash (a token decoded without the window cells it attends to is poisoned): a sliding-window
draft model rolls its drafts back and restores its rows exactly, its state after any run of
drafts, rejections and restores the state a fresh draft context reaches for the same text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
from tests.engine.conftest import make_engine, stub_config

from kvwarm.backends.base import BatchToken, ContextParams
from kvwarm.backends.stub import StubBackend
from kvwarm.cache.types import Namespace, PrefixMatch
from kvwarm.engine.types import GenerationOptions
from kvwarm.engine.worker.draftmodel import USED_MAX, DraftModel

WINDOW = 16
NS = Namespace(b"d" * 32, 1, b"c" * 32)
#: Copy-friendly text (the stub's copier drafts what followed the last two tokens before).
PHRASE = "a cat sat. "


class _Rows:
    """A draft store of whole rows in a dict (``DraftStore``, as ``CachePort`` serves it)."""

    def __init__(self) -> None:
        self.rows: dict[bytes, tuple[tuple[int, ...], bytes]] = {}

    def _match(self, key: bytes, n_shared: int) -> PrefixMatch:
        row = SimpleNamespace(key=key, n_tokens=len(self.rows[key][0]))
        return PrefixMatch(row, n_shared)  # type: ignore[arg-type]

    def draft_prefix(
        self, ns: Namespace, tokens: Sequence[int], min_shared: int
    ) -> PrefixMatch | None:
        best: PrefixMatch | None = None
        for key, (toks, _) in self.rows.items():
            shared = 0
            while shared < min(len(toks), len(tokens)) and toks[shared] == tokens[shared]:
                shared += 1
            if shared >= min_shared and (best is None or shared > best.n_shared):
                best = self._match(key, shared)
        return best

    def draft_whole_rows(self, ns: Namespace, tokens: Sequence[int]) -> list[PrefixMatch]:
        whole = [
            self._match(k, len(t))
            for k, (t, _) in self.rows.items()
            if tuple(tokens[: len(t)]) == t
        ]
        return sorted(whole, key=lambda m: -m.n_shared)

    @contextmanager
    def open_draft_row(self, key: bytes) -> Iterator[SimpleNamespace]:
        tokens, payload = self.rows[key]
        yield SimpleNamespace(tokens=tokens, payload=memoryview(payload), chunks=())

    def draft_restored(self) -> None:
        pass

    def save_draft(
        self, ns: Namespace, tokens: Sequence[int], payload: bytes, n_ctx_slot: int, quant_bits: int
    ) -> None:
        self.rows[len(self.rows).to_bytes(4, "little")] = (tuple(tokens), bytes(payload))


def _draft_model(backend: StubBackend) -> DraftModel:
    model = backend.load_model("stub-copy-draft")
    params = ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=1, swa_full=True)
    ctx = model.new_context(params)
    return DraftModel(model, ctx, NS, n_seq=1, quant_bits=16, path="draft", n_ctx_slot=512)


def _propose(
    dm: DraftModel, store: _Rows, text: list[int], prompt_len: int, *, first: bool = False
) -> list[int]:
    """A draft once the sequence has caught up with ``text`` (a prefill runs a chunk a call)."""
    for _ in range(20):
        out = dm.propose(store, 0, NS, text, prompt_len, 8, first)
        first = False
        if len(dm.held[0]) >= len(text):
            return out
    raise AssertionError("the draft context never caught up")


def _fresh(
    backend: StubBackend, text: list[int], prompt_len: int | None = None
) -> tuple[list[int], bytes]:
    """What a fresh draft context drafts after ``text``, and its KV then."""
    dm = _draft_model(backend)
    out = _propose(dm, _Rows(), text, len(text) - 1 if prompt_len is None else prompt_len)
    return out, dm.ctx.kv_pack(0)


@pytest.mark.parametrize("restore", [False, True])
def test_a_sliding_window_draft_rolls_back_and_restores_exactly(restore: bool) -> None:
    """Drafts, partly accepted, then a token the draft did not guess, again and again, far past
    the window: every draft, and the KV behind it, is the one a fresh draft context gives for
    the same text. With ``restore``, the prompt (longer than the window) comes from its row,
    which resumes at its own length only: a later prompt that shares only part of it is not
    restored from it, and a live sequence restored from it is never trimmed below it."""
    backend = StubBackend(memory_kind="swa", n_swa=WINDOW, copy_bias=8.0)
    model = backend.load_model("stub-copy-draft")
    prompt = model.tokenize(PHRASE * 6, add_special=True)
    assert len(prompt) > 3 * WINDOW
    store = _Rows()
    if restore:
        saver = _draft_model(backend)
        _propose(saver, store, [*prompt, 3], len(prompt), first=True)
        assert len(store.rows) == 1  # the prompt's KV, whole
    dm = _draft_model(backend)
    # Another prompt sharing all but the row's last tokens: the row is no use to it.
    other = [*prompt[:-3], *model.tokenize(" dog", add_special=False)]
    got, want = _propose(dm, store, other, len(other) - 1, first=True), _fresh(backend, other)
    assert (got, dm.ctx.kv_pack(0)) == want  # no cell poisoned (a window's cells missing)
    assert dm.restored_tokens == 0
    rng = random.Random(3)
    cycle = model.tokenize(PHRASE, add_special=False)
    text = [*prompt, cycle[len(prompt) % len(cycle)]]  # the prompt and the first token sampled
    first = True
    drafted = rejected = 0
    for _ in range(30):
        got = _propose(dm, store, text, len(prompt), first=first)
        first = False
        # The same draft, from the same cells (none poisoned).
        assert (got, dm.ctx.kv_pack(0)) == _fresh(backend, text, len(prompt))
        drafted += len(got)
        keep = rng.randrange(len(got) + 1)
        rejected += keep < len(got)
        # The model accepts ``keep`` tokens, then samples one the draft did not propose: the
        # phrase's next, or another where the draft guessed that.
        text += got[:keep]
        nxt = cycle[len(text) % len(cycle)]
        text.append(nxt if keep == len(got) or nxt != got[keep] else cycle[0] + 1)
        if rng.random() < 0.2:
            text = text[: max(len(prompt), len(text) - rng.randrange(1, 12))]  # a rewind
    assert drafted > 30 and rejected > 5 and len(text) > len(prompt) + WINDOW
    if restore:
        assert dm.restored_tokens >= len(prompt)
        # A next request sharing less than the restored row: its state cannot be trimmed
        # there (the cells before the row's window were never restored): it starts over.
        nxt = [*prompt[:-5], *cycle[:3]]
        got = _propose(dm, store, nxt, len(nxt) - 1, first=True)
        assert (got, dm.ctx.kv_pack(0)) == _fresh(backend, nxt)
        # A longer row sharing more of a prompt, but not all of itself, is passed over for the
        # longest row that is all the prompt's.
        longer, rows = [*prompt, *(cycle * 4)], len(store.rows)
        _propose(_draft_model(backend), store, [*longer, 3], len(longer), first=True)
        assert len(store.rows) == rows + 1
        late = _draft_model(backend)
        nxt = [*prompt, *cycle, cycle[0] + 1]
        got = _propose(late, store, nxt, len(nxt) - 1, first=True)
        assert (got, late.ctx.kv_pack(0)) == _fresh(backend, nxt)
        assert late.restored_tokens == len(prompt)


@pytest.mark.usefixtures("free_draft_passes")
def test_a_sliding_window_draft_model_gets_a_full_size_window() -> None:
    """A sliding-window draft model's context keeps every cell (``swa_full``), so the model,
    whose own context does not, drafts with it, and its greedy reply is plain decoding's (found
    on main: a sliding-window draft model was refused, its memory "cannot roll a rejected
    draft back")."""
    with make_engine() as engine:
        cfg = replace(
            stub_config(
                backend=StubBackend(memory_kind="swa", n_swa=240, copy_bias=8.0), n_batch=64
            ),
            draft_model="stub-copy-draft",
            spec_draft_max=8,
        )
        model = engine.load_model(config=cfg)
        draft = model._draft
        assert draft is not None and draft.ctx.memory.swa_full
        assert not model._worker.rt.ctx.memory.swa_full
        prompt = f"Copy this: {PHRASE * 3}Again: the cat"
        opts = GenerationOptions(max_tokens=40, temperature=0.0)
        plain = model.complete(prompt, opts, spec_type="none", cache_salt="plain")
        spec = model.complete(prompt, opts, cache_salt="draft")
        assert spec.completion_tokens == plain.completion_tokens
        assert spec.stats.accepted_tokens > 10


def test_the_namespaces_a_draft_model_used_are_the_latest_and_bounded() -> None:
    """``used`` (which rows are the drafting model's in ``/cache/stats``): its own namespace
    and the salted ones requests drafted under, the latest ``USED_MAX`` only, so a client
    sending a new salt each request grows nothing without bound (found by review: ownerkey)."""
    dm = _draft_model(StubBackend())
    try:
        assert dm.used() == {NS}
        assert dm.namespace_for(None) == NS
        first = dm.namespace_for(b"0")
        for i in range(1, USED_MAX):
            dm.namespace_for(str(i).encode())
        assert first in dm.used() and len(dm.used()) == USED_MAX + 1
        dm.namespace_for(b"0")  # used again: the latest now
        last = dm.namespace_for(b"new")
        used = dm.used()
        assert len(used) == USED_MAX + 1 and {NS, first, last} <= used
        assert dm.namespace_for(b"1") not in used  # the oldest went
    finally:
        dm.close()


def test_a_draft_kept_whole_costs_the_draft_model_one_pass_a_drafted_token() -> None:
    """A draft of ``k`` tokens kept whole: the draft context lacks only its last token (never
    decoded, it drafted nothing after it), which goes in the next draft's first pass with the
    token the model sampled, so each drafted token costs one draft pass, as ``DraftCost``
    prices it. Found by review (issue 39): that token was prefilled in a pass of its own, one
    draft pass more than drafted tokens a round (5 for a draft of 4)."""
    backend = StubBackend(copy_bias=8.0)
    dm = _draft_model(backend)
    store = _Rows()
    prompt = dm.model.tokenize(PHRASE * 6, add_special=True)
    cycle = dm.model.tokenize(PHRASE, add_special=False)
    text = [*prompt, cycle[0]]  # BOS, the phrase 6 times, its first token
    _propose(dm, store, text, len(prompt), first=True)  # the prompt, prefilled
    passes: list[int] = []
    decode, prefill = dm.ctx.decode, dm.ctx.prefill

    def counted_decode(batch: Sequence[BatchToken]) -> None:
        passes.append(len(batch))
        decode(batch)

    def counted_prefill(seq: int, tokens: Sequence[int], start_pos: int) -> None:
        passes.append(-len(tokens))  # a prefill: negative
        prefill(seq, tokens, start_pos)

    dm.ctx.decode, dm.ctx.prefill = counted_decode, counted_prefill  # type: ignore[method-assign]
    drafted = 0
    for _ in range(5):
        before = len(passes)
        got = dm.propose(store, 0, NS, text, len(prompt), 4)
        assert len(got) == 4 and len(passes) - before == 4  # one pass a drafted token
        drafted += len(got)
        text += got  # kept whole, and the model sampled what a draft model guesses next
        text.append(_fresh(backend, text)[0][0])
    assert min(passes) > 0 and sum(passes) == drafted + 4  # each ran along the next draft
    # The same draft as a fresh context's, from the same cells.
    assert (dm.propose(store, 0, NS, text, len(prompt), 4), dm.ctx.kv_pack(0)) == _fresh(
        backend, text, len(prompt)
    )
