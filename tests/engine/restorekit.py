"""The parts of the randomised differential test of cache restores
(``test_random_restores_stub.py`` says what it guards and what it cannot see): ``plan`` draws a
case's setup and steps from a seed, ``run`` runs them on one engine in deterministic mode, and
``compare`` checks each answer against the same prompt answered cold (``Reference``)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvwarm.backends.base import ContextParams
from kvwarm.backends.stub import StubBackend
from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions

#: Every request: greedy, a fixed length, logprobs with two alternatives.
OPTS = GenerationOptions(temperature=0.0, logprobs=2, ignore_eos=True)
MAX_TOKENS = 24  # a cancelled stream's; the reference answers this many once per prompt
NEVER = 1 << 40  # a save gate no prompt reaches


# ------------------------------------------------------------------------------ the target


@dataclass(frozen=True)
class Target:
    """What a case runs on: the stub with a memory kind, or a GGUF (``path``)."""

    name: str
    n_batch: int
    tokens: tuple[int, int]  # the ids prompts are drawn from, inclusive
    lengths: tuple[int, int]  # a fresh prompt's length
    n_swa: int = 0
    stub_kind: str | None = None
    path: str | None = None
    n_ctx: int = 512

    def config(self, n_parallel: int, *, disk: bool) -> ModelConfig:
        backend = (
            "llama_cpp"
            if self.stub_kind is None
            else StubBackend(memory_kind=self.stub_kind, n_swa=self.n_swa)  # type: ignore[arg-type]
        )
        cfg = ModelConfig(
            backend=backend,
            context=ContextParams(n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_batch),
            n_parallel=n_parallel,
            deterministic=True,
        )
        return replace(cfg, save_tier="disk") if disk else cfg

    def load(self, eng: Engine, n_parallel: int) -> Model:
        cfg = self.config(n_parallel, disk="disk" in eng.cache.tier_names())
        return eng.load_model(self.path, config=cfg)


@dataclass(frozen=True)
class Setup:
    """A case's engine: quotas, chunk size, policy knobs and first slot count."""

    ram: int
    disk: int | None  # None: a RAM tier only (and no restarts)
    chunk_tokens: int
    checkpoint_gap: int
    continued_interval: int
    n_parallel: int

    def policy(self, n_batch: int) -> PolicyConfig:
        return PolicyConfig(
            min_tokens=8,
            cold_min_tokens=16,
            cold_max_tokens=100_000,
            continued_interval=self.continued_interval,
            boundary_trim_tokens=0,
            boundary_align_tokens=n_batch,
            session_resume_wait_ms=5000,
            evict_save_timeout_ms=30_000,
            checkpoint_gap_tokens=self.checkpoint_gap,
        )

    def engine(self, target: Target, root: Path) -> Engine:
        tiers = [TierConfig("ram", self.ram)]
        if self.disk is not None:
            tiers.append(TierConfig("disk", self.disk, root / "disk"))
        cache = CacheConfig(tiers=tuple(tiers), chunk_tokens=self.chunk_tokens)
        return Engine(EngineConfig(cache=cache, policy=self.policy(target.n_batch)))


# ---------------------------------------------------------------------------- the reference


class Reference:
    """Cold answers: one engine whose gates save nothing, each prompt under a salt of its own,
    so it shares no rows and no live KV; every answer is checked to have reused nothing."""

    def __init__(self, target: Target) -> None:
        policy = PolicyConfig(min_tokens=NEVER, cold_min_tokens=NEVER, cold_max_tokens=NEVER)
        cache = CacheConfig(tiers=(TierConfig("ram", 1 << 20),))
        self._engine = Engine(EngineConfig(cache=cache, policy=policy))
        self._model = target.load(self._engine, 1)
        self._answers: dict[tuple[int, ...], Completion] = {}

    def __call__(self, prompt: Sequence[int]) -> Completion:
        key = tuple(prompt)
        if key not in self._answers:
            opts = replace(OPTS, max_tokens=MAX_TOKENS, cache_salt=f"cold {len(self._answers)}")
            before = self._model.status().prefilled_tokens
            out = self._model.complete(list(prompt), opts)
            assert out.stats.cached_tokens == 0, "the reference reused something"
            assert self._model.status().prefilled_tokens - before == len(prompt)
            self._answers[key] = out
        return self._answers[key]

    def close(self) -> None:
        self._engine.close()


# ------------------------------------------------------------------------------- the steps


@dataclass(frozen=True)
class Ask:
    """Prompts sent together (one thread each), or one prompt; ``cancel_after``: one prompt
    streamed and cancelled after that many fragments (0: before reading any)."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    ops: tuple[str, ...]  # how each prompt was drawn, for the log
    cancel_after: int | None = None

    def __str__(self) -> str:
        asks = [
            f"{op} n={len(p)} max={m}"
            for op, p, m in zip(self.ops, self.prompts, self.max_tokens, strict=True)
        ]
        if self.cancel_after is not None:
            return f"cancel after {self.cancel_after} fragments: {asks[0]}"
        return asks[0] if len(asks) == 1 else f"together: {'; '.join(asks)}"


@dataclass(frozen=True)
class Restart:
    n_parallel: int

    def __str__(self) -> str:
        return f"restart with {self.n_parallel} slots"


@dataclass(frozen=True)
class Evict:
    def __str__(self) -> str:
        return "evict the live KV"


@dataclass(frozen=True)
class Flush:
    def __str__(self) -> str:
        return "flush the cache"


Step = Ask | Restart | Evict | Flush


@dataclass
class Planner:
    """Draws a case's prompts: ``history`` holds each prompt asked and the reference reply
    to it, as long as it was asked for (a cancelled one's: all of it)."""

    target: Target
    rng: random.Random
    reply: Callable[[Sequence[int]], Sequence[int]]
    history: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def tokens(self, n: int) -> list[int]:
        lo, hi = self.target.tokens
        return [self.rng.randint(lo, hi) for _ in range(n)]

    def cut(self, upto: int) -> int:
        """A length in [1, upto], often at a batch or window boundary or one off it."""
        b, w = self.target.n_batch, self.target.n_swa
        marks = [m * b for m in range(1, upto // b + 1)] + ([w] if w else [])
        near = [x + d for x in marks for d in (-1, 0, 1) if 1 <= x + d <= upto]
        return self.rng.choice([self.rng.randint(1, max(1, upto)), *near])

    def prompt(self) -> tuple[str, tuple[int, ...]]:
        rng, cap = self.rng, self.target.n_ctx // 2
        lo, hi = self.target.lengths
        ops = ["fresh", "repeat", "prefix", "sibling", "sibling", "extend", "turn", "turn", "reply"]
        op = rng.choice(ops) if self.history else "fresh"
        if op == "fresh":
            if self.history and rng.random() < 0.5:  # a shared system prompt, then new text
                first = list(self.history[0][0])
                base = first[: self.cut(len(first))]
                p = base + self.tokens(rng.randint(1, max(1, hi - len(base))))
            else:
                p = self.tokens(rng.randint(lo, hi))
            return op, tuple(p[:cap])
        prev, reply = (list(x) for x in rng.choice(self.history))
        if op == "repeat":
            p = prev
        elif op == "prefix":
            p = prev[: self.cut(len(prev))]
        elif op == "sibling":
            p = prev[: self.cut(len(prev))] + self.tokens(rng.randint(1, 40))
        elif op == "extend":
            p = prev + self.tokens(rng.randint(1, 40))
        elif op == "reply":
            p = prev + reply[: rng.randint(0, len(reply))]
        else:  # a follow-up turn: the reply (maybe less its last token), then a new message
            r = reply if rng.random() < 0.5 else reply[:-1]
            p = prev + r + self.tokens(rng.randint(1, 30))
        return op, tuple(p[:cap])

    def ask(self, n: int, *, cancel_after: int | None = None) -> Ask:
        drawn = [self.prompt() for _ in range(n)]
        if cancel_after is None:
            max_tokens = tuple(self.rng.choice((0, 1, 1, 2, 3, 5, 8)) for _ in drawn)
        else:
            max_tokens = (MAX_TOKENS,)
        for (_, p), m in zip(drawn, max_tokens, strict=True):
            self.history.append((p, tuple(self.reply(p)[:m])))
        return Ask(
            tuple(p for _, p in drawn), max_tokens, tuple(op for op, _ in drawn), cancel_after
        )


def plan(
    target: Target, seed: int, n_steps: int, reply: Callable[[Sequence[int]], Sequence[int]]
) -> tuple[Setup, list[Step]]:
    """A case's setup and steps, from its seed (and the reference replies, which follow-up
    turns continue)."""
    rng = random.Random(seed)
    slots = (1, 2, 4)
    setup = Setup(
        ram=rng.choice((16 << 10, 64 << 10, 1 << 20, 64 << 20)),
        disk=rng.choice((32 << 10, 128 << 10, 1 << 30)) if rng.random() < 0.85 else None,
        chunk_tokens=rng.choice((target.n_batch, 2 * target.n_batch, 256)),
        checkpoint_gap=rng.choice((0, 0, 32)),
        continued_interval=rng.choice((10_000, 8, 24)),
        n_parallel=rng.choice(slots),
    )
    planner = Planner(target, rng, reply)
    n_parallel = setup.n_parallel
    steps: list[Step] = []
    while len(steps) < n_steps:
        r = rng.random()
        step: Step
        if r < 0.07 and setup.disk is not None:
            n_parallel = rng.choice(slots)
            step = Restart(n_parallel)
        elif r < 0.14:
            step = Evict()
        elif r < 0.18:
            step = Flush()
        elif r < 0.34 and n_parallel > 1:
            step = planner.ask(rng.randint(2, n_parallel))
        elif r > 0.92:
            step = planner.ask(1, cancel_after=rng.randint(0, 3))
        else:
            step = planner.ask(1)
        steps.append(step)
    return setup, steps


# ------------------------------------------------------------------------- the comparison


def _logprobs(c: Completion) -> list[tuple[int, float, tuple[tuple[int, str, float], ...]]]:
    return [(x.token, x.logprob, x.top) for x in c.logprobs or ()]


def compare(out: Completion, prompt: Sequence[int], max_tokens: int, ref: Completion) -> None:
    """``out`` is what a cold run answers: its first ``max_tokens`` tokens and logprobs, or a
    prefix of them if it was cancelled; and it reused no more than the prompt."""
    cached = out.stats.cached_tokens
    assert 0 <= cached <= len(prompt), f"cached_tokens {cached} of a {len(prompt)}-token prompt"
    n = len(out.completion_tokens)
    if out.stats.finish_reason == "cancelled":
        assert n <= max_tokens, f"{n} tokens for max_tokens={max_tokens}"
    else:
        assert n == max_tokens, f"{n} tokens for max_tokens={max_tokens}"
    cold = ref.completion_tokens[:n]
    assert out.completion_tokens == cold, f"tokens {out.completion_tokens}, cold {cold}"
    got, want = _logprobs(out), _logprobs(ref)[:n]
    assert len(got) == n, f"{len(got)} logprobs for {n} tokens"
    diff = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not diff, f"logprobs differ from a cold run's at tokens {diff}"


# ----------------------------------------------------------------------------- the runner


class Session:
    """One case's engine and model, restarted on the same directory when a step says so."""

    def __init__(self, target: Target, setup: Setup, root: Path) -> None:
        self.target, self.setup, self.root = target, setup, root
        self.engine = setup.engine(target, root)
        self.model = target.load(self.engine, setup.n_parallel)

    def restart(self, n_parallel: int) -> None:
        self.engine.close()
        self.engine = self.setup.engine(self.target, self.root)
        self.model = self.target.load(self.engine, n_parallel)

    def ask(self, step: Ask) -> list[Completion]:
        if step.cancel_after is not None:
            stream = self.model.stream(list(step.prompts[0]), replace(OPTS, max_tokens=MAX_TOKENS))
            if step.cancel_after:
                for i, _ in enumerate(stream):
                    if i + 1 >= step.cancel_after:
                        break
            stream.cancel()
            return [stream.result()]
        outs: list[Completion | None] = [None] * len(step.prompts)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                opts = replace(OPTS, max_tokens=step.max_tokens[i])
                outs[i] = self.model.complete(list(step.prompts[i]), opts)
            except BaseException as e:  # re-raised below, on the test's thread
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(outs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [o for o in outs if o is not None]

    def close(self) -> None:
        self.engine.close()


def run(target: Target, seed: int, n_steps: int, root: Path, reference: Reference) -> None:
    """Plan the seed's case and run it, checking every answer against ``reference``."""
    setup, steps = plan(target, seed, n_steps, lambda p: reference(p).completion_tokens)
    log = [f"{target.name} seed={seed} {setup}"]
    session = Session(target, setup, root)
    try:
        for i, step in enumerate(steps):
            log.append(f"{i}: {step}")
            try:
                if isinstance(step, Restart):
                    session.restart(step.n_parallel)
                elif isinstance(step, Evict):
                    session.model.evict()
                elif isinstance(step, Flush):
                    session.engine.cache.flush()
                else:
                    before = session.model.status().prefilled_tokens
                    outs = session.ask(step)
                    prefilled = session.model.status().prefilled_tokens - before
                    reused = [o.stats.cached_tokens for o in outs]
                    log.append(f"   cached {reused}, prefilled {prefilled}")
                    for k, (p, m, out) in enumerate(
                        zip(step.prompts, step.max_tokens, outs, strict=True)
                    ):
                        try:
                            compare(out, p, m, reference(p))
                        except AssertionError as e:
                            raise AssertionError(f"prompt {k}: {e}") from e
                    want = sum(len(p) for p in step.prompts) - sum(reused)
                    if step.cancel_after is None:
                        assert prefilled == want, "prefilled != prompt - cached"
                    else:
                        assert prefilled <= want, "prefilled > prompt - cached"
            except Exception as e:  # a wrong answer, or an error the engine should not raise
                what = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
                raise AssertionError(f"{what}\n" + "\n".join(log)) from e
    finally:
        session.close()
