"""Drafts from a draft model (``--draft-model``, ``spec_type`` "draft-simple"): a smaller model of
the same vocabulary (as llama.cpp accepts it: ``check_vocab``) decodes its own copy of each
speculating slot's text, in a context of its own, and proposes its greedy tokens; the target
verifies them as any draft (``sampling``), so the output is the target's whatever the draft
model says.

- ``DraftModel``: the draft model's context, one sequence per slot (the slot's ``seq``),
  and what each holds (``held``). A draft brings the sequence to the request's text minus its
  last token (keeping the longest common prefix of what it held: a rejected draft's cells,
  or another request's, are removed; a prefill runs one ``n_batch`` chunk per tick, with no
  draft until it has caught up; reply tokens it lacks go in the first draft pass where they
  fit), decodes that last token and then its own greedy
  tokens one at a time, each while the draft model gives it at least ``P_MIN`` (llama-server's
  ``--draft-p-min``), at most the draft's limit; each pass timed (``DraftCost``, ``cost``).
- Its own cache namespace (the draft model's fingerprint, its context's hash, the request's
  salt folded in like the target's): the first draft of a request restores the longest
  cached prefix of its prompt into the draft context instead of prefilling it again, and a
  prompt it had to prefill (``SAVE_MIN`` tokens or more) is saved there, whole.
- A sequence's KV is reused by a later request in the same slot only under the same salted
  namespace (another tenant's request starts from what the cache holds for its own).
- Vocabularies of different sizes: a draft token the model does not have ends the draft; a
  token of the text the draft model does not have ends the request's drafting (nothing after
  it can be drafted exactly), and never reaches the draft context.
- A sliding-window draft model runs with a full-size SWA cache (``swa_full``), whose live
  state trims like full attention; a row longer than its window resumes at its own length
  alone, and a sequence restored from one is never trimmed below it (``kvwarm.memory``).
- ``ModelDrafter``: one request's drafts (the ``Drafter`` interface of ``drafts``), as long
  as ``DraftBudget`` finds worth their verify pass and the draft model's passes together.

Invariants: worker thread only; the draft context decodes no token past the draft model's
vocabulary, and no draft holds one past the model's; ``held[seq]`` lists exactly what the
draft context's sequence holds (a failure clears both); a draft model's failure is logged and
ends that request's drafting, never the request; the tenant rule holds (a request restores
only rows of its own salted draft namespace).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from kvwarm.backends.base import BackendContext, BackendModel, BatchToken
from kvwarm.cache.api import LoadedRow
from kvwarm.cache.formats.key import salted_namespace
from kvwarm.cache.types import Namespace, PrefixMatch
from kvwarm.engine.worker.drafts import Cost, DraftBudget, DraftCost
from kvwarm.errors import ConfigError, KvwarmError, StateRestoreError

log = logging.getLogger(__name__)

#: A draft token the draft model gives less than this probability ends the draft
#: (llama-server's ``--draft-p-min`` default).
P_MIN = 0.75
#: A prompt the draft context had to prefill this many tokens of is saved to the cache.
SAVE_MIN = 32
#: Salted draft namespaces remembered for ``DraftModel.used`` (the latest; a client choosing
#: a new salt on every request must not grow it without bound).
USED_MAX = 4096


#: llama.cpp's tolerance of a draft model's vocabulary (``common_speculative_are_compatible``
#: in common/speculative.cpp: ``SPEC_VOCAB_MAX_SIZE_DIFFERENCE``): up to this many tokens more
#: or fewer than the model's (Qwen2.5 0.5B-3B have 151,936 tokens, 7B and up 152,064: padding).
VOCAB_MAX_SIZE_DIFFERENCE = 128
#: The first token id whose bytes are compared (``SPEC_VOCAB_CHECK_START_TOKEN_ID``): the
#: ids below are unk/BOS/EOS/pad, which models of one family may name differently (BOS and
#: EOS are compared by id where the vocabulary adds them).
VOCAB_CHECK_START = 5


def check_vocab(target: BackendModel, draft: BackendModel, draft_path: str) -> None:
    """``ConfigError`` unless ``draft``'s vocabulary is one llama.cpp accepts for ``target``
    (``common_speculative_are_compatible``): the same tokenizer, the same BOS and EOS where
    they are added, at most ``VOCAB_MAX_SIZE_DIFFERENCE`` tokens more or fewer, and the same
    bytes for every token of the ids both have from ``VOCAB_CHECK_START`` on. A draft token
    is a target token id, so a draft of another vocabulary would propose other words under
    the same ids; ids only one of the two has never cross (``DraftModel``)."""
    facts, draft_facts = target.facts, draft.facts
    n, n_draft = facts.n_vocab, draft_facts.n_vocab
    if abs(n - n_draft) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise ConfigError(
            f"draft model {draft_path} has {n_draft} tokens, the model {n}: a draft model "
            f"needs the model's vocabulary (at most {VOCAB_MAX_SIZE_DIFFERENCE} tokens more "
            "or fewer)"
        )
    tokenizer = facts.metadata.get("tokenizer.ggml.model")
    draft_tokenizer = draft_facts.metadata.get("tokenizer.ggml.model")
    if tokenizer != draft_tokenizer:
        raise ConfigError(
            f"draft model {draft_path} has a {draft_tokenizer} tokenizer, the model a "
            f"{tokenizer} one: a draft model needs the model's vocabulary"
        )
    for name, add, draft_add, token, draft_token in (
        ("BOS", facts.add_bos, draft_facts.add_bos, facts.bos, draft_facts.bos),
        ("EOS", facts.add_eos, draft_facts.add_eos, facts.eos, draft_facts.eos),
    ):
        if add != draft_add or (add and token != draft_token):
            raise ConfigError(
                f"draft model {draft_path}: its {name} token ({draft_token}, "
                f"{'added' if draft_add else 'not added'}) is not the model's ({token}, "
                f"{'added' if add else 'not added'}): a draft model needs the model's "
                "vocabulary"
            )
    common = min(n, n_draft)
    pieces, draft_pieces = target.vocabulary()[0], draft.vocabulary()[0]
    if pieces[VOCAB_CHECK_START:common] == draft_pieces[VOCAB_CHECK_START:common]:
        return
    token = next(t for t in range(VOCAB_CHECK_START, common) if pieces[t] != draft_pieces[t])
    raise ConfigError(
        f"draft model {draft_path}: token {token} differs from the model's ({draft_pieces[token]!r}"
        f", the model's {pieces[token]!r}): a draft model needs the model's vocabulary"
    )


class DraftStore(Protocol):
    """The draft context's rows in the cache, through the worker's cache port
    (``CachePort.draft_prefix`` and its siblings)."""

    def draft_prefix(
        self, ns: Namespace, tokens: Sequence[int], min_shared: int
    ) -> PrefixMatch | None: ...

    def draft_whole_rows(self, ns: Namespace, tokens: Sequence[int]) -> list[PrefixMatch]: ...

    def open_draft_row(self, key: bytes) -> AbstractContextManager[LoadedRow]: ...

    def draft_restored(self) -> None: ...

    def save_draft(
        self, ns: Namespace, tokens: Sequence[int], payload: bytes, n_ctx_slot: int, quant_bits: int
    ) -> None: ...


class DraftModel:
    """The draft model's context and what each slot's sequence of it holds."""

    def __init__(
        self,
        model: BackendModel,
        ctx: BackendContext,
        namespace: Namespace,
        *,
        n_seq: int,
        quant_bits: int,
        path: str,
        n_ctx_slot: int,
        n_target_vocab: int | None = None,
        relative_size: float = 1.0,
    ) -> None:
        self.model = model
        #: The draft model's vocabulary and the model's (they may differ by up to
        #: ``VOCAB_MAX_SIZE_DIFFERENCE``): a token of the model's past the draft's is never fed
        #: to the draft context (llama.cpp would read past its embeddings), a draft token past
        #: the model's ends the draft (``_propose``).
        self.n_vocab = model.facts.n_vocab
        self.n_target_vocab = self.n_vocab if n_target_vocab is None else n_target_vocab
        #: Its weights' size, read now: ``ModelInfo`` reports it after an unload has closed
        #: the model too (found by review: ``/v1/models`` listing a model while it unloaded
        #: failed with ``HandleClosedError``).
        self.size_bytes = model.facts.size_bytes
        self.ctx = ctx
        self.namespace = namespace  # unsalted
        self.quant_bits = quant_bits
        self.path = path
        self.n_ctx_slot = n_ctx_slot
        self.held: list[list[int]] = [[] for _ in range(n_seq)]
        #: seq -> where its prefill of the current prompt began (restored up to there): a
        #: prompt prefilled from there on by ``SAVE_MIN`` tokens or more is saved.
        self._catching: dict[int, int] = {}
        #: seq -> the (salted) draft namespace of the request its KV was computed for.
        self._owner: dict[int, Namespace] = {}
        #: Prompt tokens restored from the cache rather than prefilled (stats, tests).
        self.restored_tokens = 0
        self.prefilled_tokens = 0
        #: The salted namespaces requests drafted under, latest last, at most ``USED_MAX``:
        #: which rows are this draft model's where its file is also served (``used``).
        self._used: dict[Namespace, None] = {}
        self._used_lock = threading.Lock()
        #: What one of its passes costs in the model's (``DraftCost``): from its weights'
        #: size over the model's (``relative_size``) until its passes are timed.
        self.cost = DraftCost(relative_size)

    def namespace_for(self, salt: bytes | None) -> Namespace:
        ns = salted_namespace(self.namespace, salt)
        if salt is not None:
            with self._used_lock:
                self._used.pop(ns, None)
                self._used[ns] = None
                if len(self._used) > USED_MAX:
                    del self._used[next(iter(self._used))]
        return ns

    def used(self) -> frozenset[Namespace]:
        """The namespaces its rows live in, as far as it knows (any thread): its own and the
        ``USED_MAX`` salted ones requests drafted under last. A salt is one-way, so a salted
        row of another is known only by its namespace."""
        with self._used_lock:
            return frozenset((self.namespace, *self._used))

    def unreadable(
        self, tokens: Sequence[int], start: int = 0, stop: int | None = None
    ) -> int | None:
        """The first index of ``tokens[start:stop]`` holding a token the draft model does
        not have (a model's token past its vocabulary), or None."""
        n, stop = self.n_vocab, len(tokens) if stop is None else stop
        return next((i for i in range(start, stop) if tokens[i] >= n), None)

    def propose(
        self,
        store: DraftStore,
        seq: int,
        ns: Namespace,
        text: Sequence[int],
        prompt_len: int,
        limit: int,
        first: bool = False,
    ) -> list[int]:
        """Up to ``limit`` greedy tokens of the draft model after ``text`` (a request's prompt
        of ``prompt_len`` tokens and its reply so far, whose last token is about to be
        decoded by the target; ``first``: the request's first draft). ``KvwarmError`` on a
        failure of the draft context, any other exception on a bug: the sequence is then
        cleared either way (what it holds is no longer known)."""
        try:
            return self._propose(store, seq, ns, text, prompt_len, limit, first)
        except Exception:
            self.reset(seq)
            raise

    def _propose(
        self,
        store: DraftStore,
        seq: int,
        ns: Namespace,
        text: Sequence[int],
        prompt_len: int,
        limit: int,
        first: bool = False,
    ) -> list[int]:
        ctx, held = self.ctx, self.held[seq]
        n = len(text) - 1  # positions the sequence must hold before text[n] is decoded
        if n < 0 or limit <= 0 or len(text) + limit > self.n_ctx_slot:
            return []
        common = 0
        if self._owner.get(seq) == ns:  # another tenant's KV is never reused, even its prefix
            top = min(len(held), n)
            while common < top and held[common] == text[common]:
                common += 1
        self._owner[seq] = ns
        if common < len(held):
            common = self._trim(seq, common)
        if self.unreadable(text, common, n + 1) is not None:
            return []  # a token the draft model does not have: nothing past it is drafted
        if common < prompt_len <= n:
            common = self._restore(store, seq, ns, text[:prompt_len], common)
            if first:
                self._catching[seq] = common
        # The reply's tokens the sequence lacks (the last draft's last token, kept; tokens
        # decoded without a draft), where they fit the first draft pass: they go in it, not
        # in a pass of their own (found by review, issue 39: a draft kept whole cost the
        # draft model one pass more than it drafted tokens).
        behind: Sequence[int] = ()
        if prompt_len <= common < n and n + 1 - common <= ctx.n_batch:
            behind = text[common:n]
            self.prefilled_tokens += n - common
        elif common < n:
            # One chunk a tick (the other slots' passes wait for this one): no draft until the
            # sequence has caught up; a chunk ends at the prompt's end, for its save.
            end = min(n, common + ctx.n_batch)
            if common < prompt_len < end:
                end = prompt_len
            ctx.prefill(seq, text[common:end], common)
            held.extend(text[common:end])
            self.prefilled_tokens += end - common
            if end == prompt_len and prompt_len - self._catching.pop(seq, 0) >= SAVE_MIN:
                self._save(store, seq, ns, text[:prompt_len])
            if end < n:
                return []
        draft: list[int] = []
        token, pos = text[n], n
        while True:
            batch = [BatchToken(t, common + i, seq, False) for i, t in enumerate(behind)]
            batch.append(BatchToken(token, pos, seq, True))
            started = time.perf_counter()
            ctx.decode(batch)
            self.cost.observe(time.perf_counter() - started)
            held.extend(behind)
            held.append(token)
            row = np.frombuffer(ctx.logits(len(behind)), dtype=np.float32)
            behind = ()
            best = int(row.argmax())
            if best >= self.n_target_vocab:
                break  # a token the model does not have: never a draft token
            top_logit = float(row[best])
            p = 1.0 / float(np.exp(row - top_logit).sum())
            if not math.isfinite(p) or p < P_MIN:
                break
            draft.append(best)
            if len(draft) >= limit or self.model.is_eog(best):
                break
            token, pos = best, pos + 1
        return draft

    def _trim(self, seq: int, keep: int) -> int:
        """Keep the first ``keep`` positions of ``seq``, or none where its state cannot resume
        there (a sliding window's restored state, whose cells before its last ``n_swa`` were
        never saved: ``MemoryKind.live_floor``); how many it keeps."""
        ctx, held = self.ctx, self.held[seq]
        mem = ctx.memory
        if keep > 0 and mem.live_floor(len(held), ctx.seq_pos_min(seq)) > keep:
            keep = 0
        ctx.seq_rm(seq, keep, -1)
        if ctx.seq_pos_max(seq) != keep - 1:
            raise StateRestoreError(
                f"the draft context's seq {seq} kept positions past {keep} after a removal"
            )
        del held[keep:]
        return keep

    def _restore(
        self, store: DraftStore, seq: int, ns: Namespace, prompt: Sequence[int], common: int
    ) -> int:
        """Restore the longest cached prefix of ``prompt`` in ``ns`` into ``seq`` if it is
        longer than the ``common`` tokens held; how many tokens the sequence holds now."""
        match = store.draft_prefix(ns, prompt, common + 1)
        if match is not None and match.n_shared < self.ctx.memory.saved_floor(match.row.n_tokens):
            # A sliding window's row longer than its window resumes at its own length alone
            # (its masked cells were not saved, ``kvwarm.memory``): a row all of the prompt's.
            whole = store.draft_whole_rows(ns, prompt)
            match = next((m for m in whole if m.n_shared > common), None)
        if match is None or match.n_shared <= common:
            return common
        try:
            with store.open_draft_row(match.row.key) as row:
                if row.chunks or not row.payload:
                    return common  # not a whole row of this module's: prefill instead
                held = self.held[seq]
                held.clear()  # kv_unpack clears the sequence first
                got = self.ctx.kv_unpack(seq, row.payload)
                held.extend(row.tokens[:got])
        except KvwarmError as exc:
            log.info("draft model: restoring a cached prefix failed (%s); prefilling", exc)
            self.reset(seq)
            return 0
        keep = self._trim(seq, min(match.n_shared, len(self.held[seq])))
        self.restored_tokens += keep
        if keep > 0:
            store.draft_restored()  # counted only once a row's KV is in (not at the lookup)
        return keep

    def _save(self, store: DraftStore, seq: int, ns: Namespace, prompt: Sequence[int]) -> None:
        try:
            payload = self.ctx.kv_pack(seq)
        except KvwarmError as exc:
            log.info("draft model: packing its prompt KV failed (%s); not saved", exc)
            return
        store.save_draft(ns, prompt, payload, self.n_ctx_slot, self.quant_bits)

    def reset(self, seq: int) -> None:
        """Empty ``seq`` (after a failure: whatever it held is forgotten)."""
        self.held[seq].clear()
        self._catching.pop(seq, None)
        try:
            self.ctx.seq_rm(seq, 0, -1)
        except KvwarmError:
            log.warning("draft model: clearing seq %d failed", seq, exc_info=True)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


class ModelDrafter:
    """One request's drafts from the draft model (``drafts.Drafter``'s interface)."""

    __slots__ = (
        "asked", "budget", "draft_max", "model", "ns", "plain", "prompt", "read", "seq",
        "stopped", "store",
    )  # fmt: skip

    def __init__(
        self,
        model: DraftModel,
        store: DraftStore,
        seq: int,
        ns: Namespace,
        prompt: Sequence[int],
        draft_max: int,
        plain: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.model = model
        self.store = store
        #: What the model's one-token pass takes now (``PassCost.plain``), the unit of the
        #: draft model's passes' cost (``DraftCost``).
        self.plain = plain
        self.seq = seq
        self.ns = ns
        self.prompt = list(prompt)
        self.draft_max = draft_max
        #: The draft model failed, or the text holds a token it does not have (a model's
        #: past its vocabulary, which nothing after can be drafted past): no more drafts.
        self.stopped = False
        self.read = 0  # tokens of the text checked for one the draft model does not have
        #: How long a draft is worth, from the acceptance seen (as an n-gram draft's): a
        #: request whose drafts keep failing stops asking the draft model at all.
        self.budget = DraftBudget()
        self.asked = False  # the draft model was asked for a draft of this request

    def propose(
        self, generated: Sequence[int], limit: int, cost: Cost, *, end: bool = False
    ) -> list[int]:
        """Up to ``limit`` tokens of the draft model's (fewer where the acceptance seen makes
        a long draft not worth its passes, the verify pass's and the draft model's own:
        ``DraftCost``; none after a failure of the draft model). ``end`` as for an n-gram
        draft (``DraftBudget.length``)."""
        end = end and limit <= self.draft_max
        total = self.model.cost.total(cost, self.plain())
        limit = self.budget.length(min(limit, self.draft_max), total, end=end)
        if self.stopped or limit <= 0:
            self.budget.skipped()
            self.model.cost.idle()
            return []
        text = [*self.prompt, *generated]
        at = self.model.unreadable(text, self.read)
        self.read = len(text)
        if at is not None:
            log.info(
                "draft model %s does not have token %d (at %d): this request drafts no more",
                self.model.path,
                text[at],
                at,
            )
            self.stopped = True
            self.budget.skipped()
            return []
        try:
            first, self.asked = not self.asked, True
            return self.model.propose(
                self.store, self.seq, self.ns, text, len(self.prompt), limit, first
            )
        except KvwarmError as exc:
            log.warning(
                "draft model %s failed (%s): this request decodes plainly", self.model.path, exc
            )
            self.stopped = True
            return []
        except Exception:
            # A bug: its drafts change no token, so the request goes on without them, as an
            # n-gram drafter's fault does (found by review: it failed the request, a 500 for
            # a speed hint).
            log.exception(
                "draft model %s: drafting failed; this request decodes plainly", self.model.path
            )
            self.stopped = True
            return []

    def verified(self, drafted: int, accepted: int, after: int | None = None) -> None:
        self.budget.verified(drafted, accepted)
