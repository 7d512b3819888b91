"""A randomised differential test of speculative decoding on the real embedded model (issue
39): ``make_case`` draws a request from a seed, ``run_case`` asks it twice of one speculating
SmolLM2 ``Model``, once decoding plainly (``spec_type`` "none") and once with a random
speculative setting (an n-gram type, a ``spec_draft_max``, a prediction), and reports every
way the two differ. The claim checked: a request's reply with drafts on is plain decoding's,
token for token, with its finish reason, usage counts and logprobs bit for bit; the context
then holds exactly the cells its slots say they hold (a rejected draft's, a filler row's are
gone), and the speculative request saved the same rows the plain one did.

The two runs differ in their cache salts (``PLAIN_SALT``, ``SPEC_SALT``), the same for every
seed: neither reuses the other's rows or live KV, but each reuses its own earlier ones, so a
seed run after others drafts from the cache's rows (retries, "Request N." variants, exact
hits on a finish row's stored logits) as well as from its own text. Each namespace sees the
same requests in the same order, so as long as every reply matches, their rows hold the same
tokens. Requests are one at a time; ``n > 1`` choices decode together, but with q8_0 K cells
(a speculating model's ``auto``) a row is a one-token pass's whatever its pass carries, and
``test_n_choices_after_earlier_requests_are_plain_decodings_with_q8_0_kv`` holds them exact.

Used by ``test_speculative_fuzz_model.py`` (a few fixed seeds) and ``bench/spec_fuzz.py``
(a soak over as many seeds as one asks for)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvwarm.backends.base import ContextParams
from kvwarm.backends.llama.kv_layout import CELL, HEAD
from kvwarm.cache.formats.key import salted_namespace
from kvwarm.cache.types import CacheConfig, Namespace, PolicyConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import MAX_DRAFT_TOKENS, Completion, GenerationOptions
from kvwarm.engine.worker.drafts import Cost, PassCost
from kvwarm.errors import KvwarmError

PLAIN_SALT = "specfuzz-plain"
SPEC_SALT = "specfuzz-spec"
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")

#: How verify passes are priced for a case (``priced``): the CPU's measured cost (few and
#: short drafts), a GPU's (long drafts, many rejected), and a CPU whose matrix kernel takes
#: rows 4 at a time (filler rows after short drafts: ``Tick._pad``).
CostMode = Literal["measured", "generous", "tiled"]
COSTS: dict[str, Cost] = {
    "generous": Cost(0.0, 0.05),
    "tiled": Cost(0.0, 0.05, tile=4, step=1.0),
}

# ------------------------------------------------------------------------------ the pool

CODES = (
    "def area(width, height):\n"
    "    if width < 0 or height < 0:\n"
    "        raise ValueError('negative size')\n"
    "    return width * height\n",
    "def merge(left, right):\n"
    "    result = []\n"
    "    while left and right:\n"
    "        result.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
    "    return result + left + right\n",
    "class Counter:\n"
    "    def __init__(self):\n"
    "        self.count = 0\n"
    "\n"
    "    def add(self, n=1):\n"
    "        self.count += n\n"
    "        return self.count\n",
)
DOCS = (
    '{"name": "Ada", "age": 36, "langs": ["en", "fr"], "city": "London", "job": "analyst"}',
    '{"id": 7, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-9", "qty": 1}], "paid": true}',
)
PASSAGES = (
    "The harbour light turns every night at nine, and the keeper writes it down in a book. "
    "In winter the book fills faster, because the storms come early and the ships come late.",
    "Over 2,900 people live in the valley, over 2,300 of them in the town by the river. "
    "The rest keep sheep on the hills and come down to the market on Saturdays.",
)
CONTENTS = CODES + DOCS + PASSAGES
ASKS = (
    "Repeat this exactly:\n\n{x}",
    "Request {r}. Repeat this exactly:\n\n{x}",
    "Copy the text below, then stop.\n\n{x}",
    "Rewrite this, changing nothing but the first word:\n\n{x}",
    "Quote the first line of this:\n\n{x}",
    "Explain in one sentence what this is:\n\n{x}",
)
FREE = (
    "Write four short lines about rain in a city.",
    "List three colours, one a line.",
    "Say hello.",
)
#: Plain completions (no template): the text goes on with a copy.
RAW = (
    "Original:\n\n{x}\nThe same, copied:\n\n",
    "{x}\n{x}\n",
    "Request {r}.\n{x}\nAgain:\n{half}",
)

GRAMMARS = (
    'root ::= [^\\n]+ ("\\n" [^\\n]+)*',
    'root ::= "def " [a-z_]+ "(" [^\\n]* "\\n" ("    " [^\\n]* "\\n")*',
    'root ::= [A-Za-z ,.]+ "."',
    'root ::= ("{" [^\\n]* "}") | ([a-z ]+)',
)
SCHEMAS: tuple[dict[str, object], ...] = (
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "langs": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"type": "integer"}, "maxItems": 12},
)
#: A lazy grammar: free text until the trigger, then its rule.
LAZY = ("def", 'root ::= "def " [a-z_]+ "(" [a-z_, ]* "):"')


# ------------------------------------------------------------------------------ the case


@dataclass(frozen=True)
class Case:
    """One seed's request. ``prompt`` is a text, or ``follow_up`` asks the same again with
    the first reply appended as tokens (an exact hit on its finish row's stored logits)."""

    seed: int
    chat: bool
    prompt: str
    options: GenerationOptions  # shared by both runs (no spec_type, draft_max, prediction)
    n: int
    spec_type: str | None  # None: the model's
    spec_draft_max: int | None
    prediction: Literal["none", "content", "plain", "edited", "other"]
    cost: CostMode
    follow_up: bool
    content: str
    long: bool = False  # its prompt leaves the reply less room than max_tokens

    def describe(self) -> str:
        o, d = self.options, GenerationOptions()
        parts = [
            f"{'chat' if self.chat else 'text'}",
            f"n={self.n}",
            f"spec={self.spec_type or 'model'}/{self.spec_draft_max}",
            f"pred={self.prediction}",
            f"cost={self.cost}",
            f"max={o.max_tokens}",
            "greedy" if o.temperature == 0.0 else f"T={o.temperature:.2f} seed={o.seed}",
        ]
        if o.top_k != d.top_k:
            parts.append(f"top_k={o.top_k}")
        if o.top_p != d.top_p:
            parts.append(f"top_p={o.top_p:.2f}")
        if o.min_p != d.min_p:
            parts.append(f"min_p={o.min_p:.2f}")
        if o.repeat_penalty != 1.0 or o.presence_penalty or o.frequency_penalty:
            parts.append(
                f"pen={o.repeat_penalty:.2f}/{o.presence_penalty:.2f}/{o.frequency_penalty:.2f}"
            )
        if o.logit_bias:
            parts.append(f"bias={dict(o.logit_bias)}")
        if o.stop:
            parts.append(f"stop={list(o.stop)}")
        if o.grammar is not None:
            parts.append("lazy" if o.grammar_triggers else "gbnf")
        if o.json_schema is not None:
            parts.append("schema")
        if o.logprobs is not None:
            parts.append(f"lp={o.logprobs}")
        if o.ignore_eos:
            parts.append("ignore_eos")
        if o.n_indent:
            parts.append(f"n_indent={o.n_indent}")
        if self.follow_up:
            parts.append("follow-up")
        if self.long:
            parts.append("long")
        return " ".join(parts)


def make_case(seed: int, model: Model) -> Case:
    """The request seed ``seed`` stands for (``model`` tokenizes the content for biases)."""
    rng = random.Random(seed)
    content = rng.choice(CONTENTS)
    r = rng.randint(1, 4)
    chat = rng.random() < 0.6
    if chat:
        prompt = rng.choice(FREE) if rng.random() < 0.12 else rng.choice(ASKS)
    else:
        prompt = rng.choice(RAW)
    side = random.Random(seed ^ 0x5EED)  # drawn apart: the other seeds' cases stay
    long = side.random() < 0.1
    if long:
        # A prompt that leaves less room than max_tokens in the slot's window (512 cells):
        # the reply ends with it, its drafts capped by it.
        target = side.randint(380, 440)
        while len(model.tokenize(content, add_special=False)) < target:
            content += "\n" + rng.choice(CONTENTS)
        prompt = ASKS[0] if chat else RAW[0]  # the content once
    prompt = prompt.format(x=content, r=r, half=content[: len(content) // 2])
    greedy = rng.random() < 0.5
    opts = GenerationOptions(
        max_tokens=rng.choice([1, 2, *[rng.randint(3, 24), rng.randint(24, 80)] * 3, 80, 80]),
        temperature=0.0 if greedy else rng.choice([0.2, 0.5, 0.8, 1.0, 1.3]),
        seed=None if greedy and rng.random() < 0.5 else rng.randint(0, 10_000),
        logprobs=rng.choice([None, None, 0, 1, 3]),
        ignore_eos=rng.random() < 0.1,
    )
    if not greedy:
        if rng.random() < 0.4:
            opts = replace(opts, top_k=rng.choice([1, 5, 40, 0]))
        if rng.random() < 0.4:
            opts = replace(opts, top_p=rng.choice([0.3, 0.8, 0.95]))
        if rng.random() < 0.3:
            opts = replace(opts, min_p=rng.choice([0.02, 0.1, 0.3]))
    if rng.random() < 0.3:
        opts = replace(
            opts,
            repeat_penalty=rng.choice([1.0, 1.1, 1.3]),
            presence_penalty=rng.choice([0.0, 0.5, -0.5]),
            frequency_penalty=rng.choice([0.0, 0.3, 1.0]),
        )
    if rng.random() < 0.25:
        pool = model.tokenize(content, add_special=False)
        picked = rng.sample(pool, min(len(pool), rng.randint(1, 4)))
        opts = replace(opts, logit_bias={t: rng.choice([-100.0, -5.0, -1.0, 2.0]) for t in picked})
    if rng.random() < 0.35:
        words = [w for w in content.replace("\n", " ").split(" ") if w]
        at = rng.randrange(len(content) - 6)
        picks = [
            rng.choice(words),
            content[at : at + rng.randint(1, 6)],
            "\n\n",
            rng.choice(["return", "}", ".", ", "]),
        ]
        opts = replace(opts, stop=tuple(rng.sample(picks, rng.randint(1, 2))))
    shaped = rng.random()
    if shaped < 0.08:
        opts = replace(opts, grammar=rng.choice(GRAMMARS))
    elif shaped < 0.14:
        opts = replace(opts, json_schema=rng.choice(SCHEMAS))
    elif shaped < 0.17:
        opts = replace(opts, grammar=LAZY[1], grammar_triggers=(LAZY[0],))
    if not chat and content in CODES and rng.random() < 0.2:
        opts = replace(opts, n_indent=rng.choice([1, 4]))
    # n > 1 choices without a seed would each draw their own: nothing to compare.
    n = rng.choice([1, 1, 1, 2, 3]) if opts.seed is not None or greedy else 1
    spec_type = rng.choice([None, *NGRAM_TYPES])
    draft_max = rng.choice([None, None, None, 0, 1, rng.randint(2, 16), rng.randint(16, 62), 62])
    prediction = rng.choice(["none", "none", "none", "content", "plain", "edited", "other"])
    cost: CostMode = rng.choice(["measured", "generous", "generous", "tiled"])
    return Case(
        seed=seed,
        chat=chat,
        prompt=prompt,
        options=opts,
        n=n,
        spec_type=spec_type,
        spec_draft_max=draft_max,
        prediction=prediction,  # type: ignore[arg-type]
        cost=cost,
        follow_up=rng.random() < 0.12,
        content=content,
        long=long,
    )


# ------------------------------------------------------------------------------ running it


@contextmanager
def priced(mode: CostMode) -> Iterator[None]:
    """Verify passes priced as ``mode`` says while the block runs (one model's worker reads
    ``PassCost.cost`` as it drafts)."""
    if mode == "measured":
        yield
        return
    cost = COSTS[mode]
    prop = PassCost.__dict__["cost"]
    PassCost.cost = property(lambda self: cost)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        PassCost.cost = prop  # type: ignore[method-assign]


@dataclass
class Paths:
    """How often the draft sources past a request's own text were used (``traced``)."""

    row_matches: int = 0  # a lookup in the namespace's cached rows found a match
    replays: int = 0  # a row (an earlier reply, a prediction) replayed the request
    predicted: int = 0  # a prediction's row matched


@contextmanager
def traced() -> Iterator[Paths]:
    """Count, while the block runs, the drafts the cache's rows and predictions offered."""
    from kvwarm.engine.worker.drafts import Drafter, Predicted, RowDrafts, RowMatch

    paths = Paths()
    matches, replay, predicted = RowDrafts.matches, Drafter._replay, Predicted.matches

    def rows(self: RowDrafts, ns: Namespace, text: Sequence[int]) -> list[RowMatch]:
        found = matches(self, ns, text)
        paths.row_matches += bool(found)
        return found

    def replayed(self: Drafter, limit: int) -> tuple[list[int], int, bool, bool] | None:
        got = replay(self, limit)
        paths.replays += got is not None
        return got

    def prediction(self: Predicted, text: Sequence[int]) -> list[RowMatch]:
        found = predicted(self, text)
        paths.predicted += bool(found)
        return found

    RowDrafts.matches = rows  # type: ignore[method-assign]
    Drafter._replay = replayed  # type: ignore[method-assign]
    Predicted.matches = prediction  # type: ignore[method-assign]
    try:
        yield paths
    finally:
        RowDrafts.matches = matches  # type: ignore[method-assign]
        Drafter._replay = replay  # type: ignore[method-assign]
        Predicted.matches = predicted  # type: ignore[method-assign]


def fuzz_engine(ram_mb: int = 1024) -> Engine:
    """An engine whose RAM tier holds many rows (evictions would make the two namespaces'
    rows differ) and whose gates save short prompts."""
    from tests.engine.conftest import LOW_GATES

    tiers = (TierConfig("ram", ram_mb << 20),)
    policy: PolicyConfig = LOW_GATES
    return Engine(EngineConfig(cache=CacheConfig(tiers=tiers), policy=policy))


def fuzz_config(n_ctx_slot: int = 512, spec_ngram_n: int = 3) -> ModelConfig:
    """SmolLM2 in three slots (``n`` up to 3), its cells ``auto`` (q8_0 K: exact at any
    length), drafting with ``ngram-simple`` where a request names no type."""
    return ModelConfig(
        context=ContextParams(n_ctx=3 * n_ctx_slot, n_batch=64, n_ubatch=64, n_threads=2),
        n_parallel=3,
        spec_type="ngram-simple",
        spec_ngram_n=spec_ngram_n,
    )


@dataclass
class Outcome:
    """What one seed found: mismatches (each a line), drafts, and what it ran."""

    case: Case
    mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Stages after whose plain run some slot's cells were out of position order.
    disordered: set[int] = field(default_factory=set)
    drafted: int = 0
    accepted: int = 0
    plain_tokens: int = 0

    def line(self) -> str:
        verdict = "ok" if not self.mismatches else f"MISMATCH ({len(self.mismatches)})"
        return (
            f"seed {self.case.seed}: {verdict} drafted={self.drafted} accepted={self.accepted} "
            f"tokens={self.plain_tokens} | {self.case.describe()}"
        )


def _ask(
    model: Model, case: Case, prompt: str | Sequence[int], opts: GenerationOptions
) -> list[Completion]:
    if case.n == 1:
        if case.chat and isinstance(prompt, str):
            return [model.chat([{"role": "user", "content": prompt}], options=opts)]
        return [model.complete(prompt, opts)]
    if case.chat and isinstance(prompt, str):
        streams = model.chat_streams(
            [{"role": "user", "content": prompt}], n=case.n, options=opts, fragments=False
        )
    else:
        streams = model.streams(prompt, opts, n=case.n, fragments=False)
    return [s.result() for s in streams]


def _attempt(
    model: Model, case: Case, prompt: str | Sequence[int], opts: GenerationOptions
) -> tuple[list[Completion], str | None]:
    """The request's replies, or none and the error it raised (its type and message)."""
    try:
        return _ask(model, case, prompt, opts), None
    except KvwarmError as exc:
        return [], repr(exc)


def _prediction(case: Case, plain: Completion, rng: random.Random) -> str | None:
    if case.prediction == "content":
        return case.content
    if case.prediction == "plain":
        return plain.text or None
    if case.prediction == "edited":
        words = plain.text.split(" ")
        if len(words) < 3:
            return plain.text or None
        at = rng.randrange(len(words))
        words[at] = "umbrella" if words[at] != "umbrella" else "street"
        return " ".join(words)
    if case.prediction == "other":
        return rng.choice(CONTENTS)
    return None


def empty_slots(model: Model) -> None:
    """Every slot's KV dropped, so the next request's cells are placed from the first in
    position order whatever ran before: in one unified KV buffer the cells left by earlier
    requests (the other salt's, a verify pass's) decide where a sequence's cells go, and
    attention adds them in cell order (docs/internals.md, "Cell order": plain decoding's own
    replies change with them), which is no part of what speculation promises."""
    rt = model._worker.rt

    def empty() -> None:
        for slot in rt.slots:
            rt.reset_seq(slot)

    model._worker.call(empty).result(60)


def _cell_positions(blob: bytes) -> npt.NDArray[np.int32]:
    """The position each cell of one sequence's ``kv_pack`` blob holds, in cell order (its
    first KV cache; cells without ``llama_kv_cell_ext``, as SmolLM2's and Gemma 3's)."""
    n_cells = HEAD.unpack_from(blob, 0)[3]
    table = np.frombuffer(blob, dtype="<i4", count=n_cells * CELL // 4, offset=HEAD.size)
    return table.reshape(n_cells, CELL // 4)[:, 0]


def cells_check(model: Model) -> list[str]:
    """On the worker thread, between its rounds: each slot's sequence holds exactly the cells
    its ``kv_tokens`` say (positions ``0 .. n - 1``, ``n`` cells, none past them: no rejected
    draft or filler row left); what is wrong, one line each."""
    worker = model._worker
    rt = worker.rt

    def check() -> list[str]:
        wrong = []
        ctx = rt.ctx
        for slot in rt.slots:
            n = len(slot.kv_tokens)
            lo, hi = ctx.seq_pos_min(slot.seq), ctx.seq_pos_max(slot.seq)
            if n == 0:
                if hi != -1:
                    wrong.append(f"slot {slot.seq}: holds positions {lo}..{hi}, its kv_tokens none")
                continue
            if (lo, hi) != (0, n - 1):
                wrong.append(f"slot {slot.seq}: holds positions {lo}..{hi}, kv_tokens {n}")
            cells = len(_cell_positions(ctx.kv_pack(slot.seq)))
            if cells != n:
                wrong.append(f"slot {slot.seq}: {cells} cells, kv_tokens {n}")
        return wrong

    return worker.call(check).result(60)


def disordered(model: Model) -> list[int]:
    """The slots whose cells are out of position order (on the worker thread): there
    attention adds the cells in another order than a fresh context's, so their logits are no
    fresh context's (docs/internals.md, "Cell order is numerics")."""
    rt = model._worker.rt

    def check() -> list[int]:
        out = []
        for slot in rt.slots:
            if slot.kv_tokens and np.any(np.diff(_cell_positions(rt.ctx.kv_pack(slot.seq))) <= 0):
                out.append(slot.seq)
        return out

    return model._worker.call(check).result(60)


def _rows(engine: Engine, model: Model, salt: str) -> dict[bytes, tuple[int, ...]]:
    ns = salted_namespace(model.namespace(), salt.encode())
    found = {}
    for info in engine.cache.rows(ns):
        tokens = engine.cache.row_tokens(info.key)
        if tokens is not None:
            found[info.key] = tokens
    return found


def _first_difference(a: Sequence[object], b: Sequence[object]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _compare(where: str, plain: list[Completion], spec: list[Completion], out: Outcome) -> None:
    for i, (p, s) in enumerate(zip(plain, spec, strict=True)):
        at = f"{where} choice {i}"
        if s.prompt_tokens != p.prompt_tokens:
            out.mismatches.append(f"{at}: prompt tokens differ")
        if s.completion_tokens != p.completion_tokens:
            k = _first_difference(p.completion_tokens, s.completion_tokens)
            out.mismatches.append(
                f"{at}: tokens differ from #{k} (plain {len(p.completion_tokens)}, spec "
                f"{len(s.completion_tokens)}): plain {p.text!r} spec {s.text!r}"
            )
        elif s.text != p.text:
            out.mismatches.append(f"{at}: text differs: plain {p.text!r} spec {s.text!r}")
        ps, ss = p.stats, s.stats
        if (ss.finish_reason, ss.stop_sequence, ss.stopped_by) != (
            ps.finish_reason, ps.stop_sequence, ps.stopped_by,
        ):  # fmt: skip
            out.mismatches.append(
                f"{at}: finish {ps.finish_reason}/{ps.stop_sequence!r}/{ps.stopped_by} against "
                f"{ss.finish_reason}/{ss.stop_sequence!r}/{ss.stopped_by}"
            )
        if (ss.completion_tokens, ss.prompt_tokens) != (ps.completion_tokens, ps.prompt_tokens):
            out.mismatches.append(
                f"{at}: usage {ps.prompt_tokens}+{ps.completion_tokens} against "
                f"{ss.prompt_tokens}+{ss.completion_tokens}"
            )
        if s.logprobs != p.logprobs:
            if s.logprobs is None or p.logprobs is None:
                out.mismatches.append(f"{at}: logprobs given on one side only")
            else:
                k = _first_difference(p.logprobs, s.logprobs)
                out.mismatches.append(
                    f"{at}: logprobs differ from #{k} ({len(p.logprobs)} against {len(s.logprobs)})"
                )
        if ps.drafted_tokens:
            out.mismatches.append(f"{at}: the plain run drafted {ps.drafted_tokens} tokens")
        out.drafted += ss.drafted_tokens
        out.accepted += ss.accepted_tokens
        out.plain_tokens += len(p.completion_tokens)


def _compare_rows(
    rows_plain: dict[bytes, tuple[int, ...]],
    rows_spec: dict[bytes, tuple[int, ...]],
    new: tuple[set[bytes], set[bytes]],
    plain: list[Completion],
    spec: list[Completion],
    out: Outcome,
) -> None:
    """The rows the speculative request saved hold tokens of its own text only (its prompt
    and a choice's reply, as far as decoded: accepted tokens, never a rejected draft's), and
    each choice's finish row the tokens the plain run's holds. Continued saves are not
    compared: one fires at the first length ``continued_interval`` past the last, which a
    verify pass may cross by several tokens (a row of other length, the same tokens)."""
    new_plain = {k: v for k, v in rows_plain.items() if k in new[0]}
    new_spec = {k: v for k, v in rows_spec.items() if k in new[1]}
    texts = [c.prompt_tokens + c.completion_tokens for c in spec]
    for key, tokens in new_spec.items():
        if not any(text[: len(tokens)] == tokens for text in texts):
            out.mismatches.append(f"row {key.hex()[:12]} holds tokens not of a reply")
    for i, (p, s) in enumerate(zip(plain, spec, strict=True)):
        held_p = rows_plain.get(p.stats.key) if p.stats.key is not None else None
        held_s = rows_spec.get(s.stats.key) if s.stats.key is not None else None
        if held_p != held_s:
            out.mismatches.append(
                f"reply {i}: finish rows hold "
                f"{None if held_p is None else len(held_p)} and "
                f"{None if held_s is None else len(held_s)} tokens"
            )
        if s.stats.cached_tokens != p.stats.cached_tokens:
            out.notes.append(
                f"reply {i}: cached tokens {p.stats.cached_tokens} against {s.stats.cached_tokens}"
            )
    if sorted(new_plain.values()) != sorted(new_spec.values()):
        out.notes.append(
            f"rows saved: plain {sorted(len(t) for t in new_plain.values())} "
            f"spec {sorted(len(t) for t in new_spec.values())}"
        )


def _run(
    engine: Engine,
    model: Model,
    case: Case,
    opts: GenerationOptions,
    out: Outcome,
    *,
    plain: list[list[Completion]] | None = None,
    rng: random.Random | None = None,
) -> tuple[list[list[Completion]], str | None]:
    """The case's stages in one salt from empty slots (its follow-up right after its first
    request, reusing that request's live KV): each stage's replies, or the error one raised.
    Speculating (``plain`` given), each stage is predicted from the plain reply."""
    mode = "plain" if plain is None else "spec"
    prompts: list[str | list[int]] = [case.prompt]
    done: list[list[Completion]] = []
    empty_slots(model)
    for stage in range(2 if case.follow_up else 1):
        if stage:
            first = (plain or done)[0][0]  # the plain reply's tokens on both sides
            prompts.append(list(first.prompt_tokens + first.completion_tokens))
            case = replace(case, chat=False)
        if plain is not None and rng is not None and stage < len(plain):
            opts = replace(opts, prediction=_prediction(case, plain[stage][0], rng))
        replies, error = _attempt(model, case, prompts[stage], opts)
        engine.cache.flush()
        out.mismatches += [f"stage {stage} after {mode}: {w}" for w in cells_check(model)]
        if plain is None and disordered(model):
            out.disordered.add(stage)
        if error is not None:
            return done, error
        done.append(replies)
        if plain is not None and stage >= len(plain):
            break
    return done, None


def run_case(engine: Engine, model: Model, case: Case) -> Outcome:
    """Ask ``case`` plainly, then speculating; compare replies, cells and rows."""
    out = Outcome(case)
    with priced(case.cost):
        plain_opts = replace(case.options, spec_type="none", cache_salt=PLAIN_SALT)
        spec_opts = replace(
            case.options,
            spec_type=case.spec_type,
            spec_draft_max=case.spec_draft_max,
            cache_salt=SPEC_SALT,
        )
        before_p = _rows(engine, model, PLAIN_SALT)
        before_s = _rows(engine, model, SPEC_SALT)
        plain, plain_error = _run(engine, model, case, plain_opts, out)
        rng = random.Random(case.seed * 7919 + 1)
        spec, spec_error = _run(engine, model, case, spec_opts, out, plain=plain, rng=rng)
    for stage, (p, s) in enumerate(zip(plain, spec, strict=False)):
        if stage not in out.disordered:
            _compare(f"stage {stage}", p, s, out)
            continue
        # The plain reply is itself not a fresh context's: some slot's cells went out of
        # position order (an n > 1 follow-up on live KV whose forks freed cells below it:
        # docs/internals.md, "Cell order", "Not fixed"). What differs is a note.
        void = Outcome(case)
        _compare(f"stage {stage}", p, s, void)
        out.drafted, out.accepted = out.drafted + void.drafted, out.accepted + void.accepted
        out.plain_tokens += void.plain_tokens
        out.notes += [f"plain cells out of position order: {m}" for m in void.mismatches]
        if stage == 0:
            return out  # the rows of this case follow from its replies
    if plain_error or spec_error or len(plain) != len(spec):
        if plain_error == spec_error and len(plain) == len(spec):
            out.notes.append(f"both raised {plain_error}")  # a request error, the same one
        else:
            out.mismatches.append(
                f"speculating raised {spec_error} after {len(spec)} stages, plainly "
                f"{plain_error} after {len(plain)}"
            )
        return out
    if out.disordered:
        return out  # the rows hold the replies, which may differ
    after_p = _rows(engine, model, PLAIN_SALT)
    after_s = _rows(engine, model, SPEC_SALT)
    _compare_rows(
        after_p,
        after_s,
        (set(after_p) - set(before_p), set(after_s) - set(before_s)),
        [c for replies in plain for c in replies],
        [c for replies in spec for c in replies],
        out,
    )
    return out


def replay_command(seeds: Sequence[int]) -> str:
    return "PYTHONPATH=src .venv/bin/python bench/spec_fuzz.py --seeds " + ",".join(
        str(s) for s in seeds
    )


def dump_case(case: Case) -> str:
    """A case as JSON (its options' fields that differ from the defaults)."""
    o = case.options
    opts = {
        f: getattr(o, f)
        for f in o.__dataclass_fields__
        if getattr(o, f) != getattr(GenerationOptions(), f)
    }
    return json.dumps(
        {"seed": case.seed, "chat": case.chat, "prompt": case.prompt, "options": opts},
        default=str,
    )


assert MAX_DRAFT_TOKENS == 62  # spec_draft_max is drawn up to it
