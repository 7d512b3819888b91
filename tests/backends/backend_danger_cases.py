"""Misuse scenarios every backend must survive with a typed error.

Each ``case_*`` function takes a backend name, provokes one misuse and asserts the exact
``KvwarmError`` subclass. The stub runs them in-process; the llama.cpp backend runs each in a
child process (``python -m tests.backends.backend_danger_cases <backend> <case>``) so that an
abort fails one test instead of killing pytest. A case prints ``CASE-OK`` last; the parent
checks for it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvwarm.backends import get_backend
from kvwarm.backends.base import BackendModel, BatchToken, ContextParams, SamplingParams
from kvwarm.errors import (
    AdapterError,
    ContextOverflowError,
    GrammarError,
    HandleClosedError,
    InvalidRequestError,
    KvwarmError,
    NoLogitsError,
    StateRestoreError,
)

P = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=2)
PROMPT = "The cat sat on the mat and looked at the door."


def load(backend: str) -> BackendModel:
    if backend == "stub":
        path = "stub-model"
    else:
        from kvwarm.embedded import default_model_path

        path = str(default_model_path())
    return get_backend(backend).load_model(path)


def expect(kind: type[KvwarmError], fn: Callable[[], object]) -> None:
    try:
        fn()
    except kind:
        return
    except KvwarmError as exc:
        raise AssertionError(f"expected {kind.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def _prefilled(backend: str) -> tuple[BackendModel, object, bytes]:
    model = load(backend)
    ctx = model.new_context(P)
    ctx.prefill(0, model.tokenize(PROMPT), 0)
    return model, ctx, ctx.kv_pack(0)


def case_wide_prefill(backend: str) -> None:
    """A full 512-token batch with the default load options: on CPUs with AMX the pinned
    llama.cpp's AMX matmul segfaults here unless weights stay out of its buffer type."""
    model = load(backend)
    ctx = model.new_context(ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2))
    tokens = (model.tokenize(PROMPT) * 64)[:512]
    ctx.prefill(0, tokens, 0)
    logits = memoryview(ctx.logits(-1)).cast("B").cast("f")
    assert len(logits) == model.facts.n_vocab
    assert all(x == x and abs(x) < 1e6 for x in logits)  # finite: no NaN, no blow-up


def case_garbage_blob(backend: str) -> None:
    _model, ctx, blob = _prefilled(backend)
    expect(StateRestoreError, lambda: ctx.kv_unpack(1, os.urandom(len(blob))))
    expect(StateRestoreError, lambda: ctx.kv_unpack(1, bytes(len(blob))))
    expect(StateRestoreError, lambda: ctx.kv_unpack(1, b"\x01" * 7))
    assert ctx.seq_pos_max(1) == -1  # a failed restore leaves the sequence empty


def case_truncated_blob(backend: str) -> None:
    _model, ctx, blob = _prefilled(backend)
    for cut in (len(blob) // 2, len(blob) - 1, 20):
        expect(StateRestoreError, lambda cut=cut: ctx.kv_unpack(1, blob[:cut]))
    expect(StateRestoreError, lambda: ctx.kv_unpack(1, blob + b"\0\0"))
    assert ctx.kv_unpack(1, blob) == ctx.seq_pos_max(0) + 1  # the context is still usable


def case_blob_other_type_k(backend: str) -> None:
    model, _ctx, blob = _prefilled(backend)
    other = model.new_context(
        ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, type_k="q8_0", n_threads=2)
    )
    expect(StateRestoreError, lambda: other.kv_unpack(0, blob))


def case_blob_longer_than_context(backend: str) -> None:
    model = load(backend)
    big = model.new_context(ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2))
    tokens = model.tokenize(PROMPT * 40)[:300]
    big.prefill(0, tokens, 0)
    blob = big.kv_pack(0)
    small = model.new_context(P)
    expect(StateRestoreError, lambda: small.kv_unpack(0, blob))


def case_over_long_prompt(backend: str) -> None:
    model = load(backend)
    ctx = model.new_context(P)
    tokens = model.tokenize(PROMPT * 40)
    assert len(tokens) > P.n_ctx
    expect(ContextOverflowError, lambda: ctx.prefill(0, tokens, 0))
    assert ctx.seq_pos_max(0) == -1
    ctx.prefill(0, tokens[:10], 0)
    expect(ContextOverflowError, lambda: ctx.prefill(0, tokens[: P.n_ctx], 10))
    expect(ContextOverflowError, lambda: ctx.decode([BatchToken(tokens[0], P.n_ctx, 1, True)]))


def case_batch_past_n_ctx(backend: str) -> None:
    """llama.cpp clamps a causal context's n_batch to its n_ctx and asserts on a larger batch:
    two sequences of 16 tokens each in a context of n_ctx 16, n_batch 64 aborted it."""
    model = load(backend)
    ctx = model.new_context(ContextParams(n_ctx=16, n_batch=64, n_ubatch=64, n_seq_max=2,
                                          n_threads=2))  # fmt: skip
    tokens = (model.tokenize(PROMPT) * 2)[:16]
    batch = [BatchToken(t, i, seq, logits=False) for seq in (0, 1) for i, t in enumerate(tokens)]
    expect(InvalidRequestError, lambda: ctx.decode(batch))
    assert ctx.seq_pos_max(0) == ctx.seq_pos_max(1) == -1
    ctx.decode(batch[:16])  # one sequence's 16 fit
    assert ctx.seq_pos_max(0) == 15


def case_n_batch_at_int32_max(backend: str) -> None:
    """n_batch 2**31 - 1 passes ContextParams.validate; the context's batch was allocated with
    that many rows, and llama_batch_init's ``n_tokens_alloc + 1`` overflowed: it wrote through
    a NULL pointer (a segfault as the context was made). No call holds more than n_ctx."""
    model = load(backend)
    ctx = model.new_context(ContextParams(n_ctx=64, n_batch=2**31 - 1, n_ubatch=64,
                                          n_threads=2))  # fmt: skip
    tokens = (model.tokenize(PROMPT) * 8)[:64]
    ctx.prefill(0, tokens, 0)  # a whole n_ctx in one call: the batch holds it
    assert ctx.seq_pos_max(0) == 63
    assert len(memoryview(ctx.logits(-1)).cast("B").cast("f")) == model.facts.n_vocab


def case_embed_with_rank_pooling(backend: str) -> None:
    """A rank-pooled sequence keeps its classifier outputs alone (n_cls_out floats): embed()
    read n_embd floats from there, past their end (found by review)."""
    model = load(backend)
    ctx = model.new_context(ContextParams(n_ctx=64, n_batch=32, n_ubatch=32, n_threads=2,
                                          embeddings=True, pooling="rank"))  # fmt: skip
    expect(InvalidRequestError, lambda: ctx.embed(model.tokenize(PROMPT)[:8]))


def case_positions_past_int32(backend: str) -> None:
    """llama_pos is an int32 and ctypes wraps a larger value silently: seq_rm(seq, 2**32)
    removed the whole sequence, seq_cp(..., p1=2**32 + 3) copied 3 positions (found by
    review)."""
    model = load(backend)
    ctx = model.new_context(P)
    tokens = model.tokenize(PROMPT)[:8]
    ctx.prefill(0, tokens, 0)
    expect(InvalidRequestError, lambda: ctx.seq_rm(0, 2**32, -1))
    expect(InvalidRequestError, lambda: ctx.seq_cp(0, 1, 0, 2**32 + 3))
    expect(InvalidRequestError, lambda: ctx.seq_rm(0, 1.5, -1))  # type: ignore[arg-type]
    assert ctx.seq_pos_max(0) == len(tokens) - 1 and ctx.seq_pos_max(1) == -1


def case_sampler_ints_past_int32(backend: str) -> None:
    """top_k and repeat_last_n are C int32s, the seed a uint32: ctypes kept a larger value's
    low 32 bits, so top_k=2**32 + 1 sampled as top-1, silently (found by review)."""
    model = load(backend)
    expect(InvalidRequestError, lambda: model.new_sampler(SamplingParams(top_k=2**32 + 1)))
    # Below INT32_MIN wraps as well: -(2**32) + 1 was top_k=1 in C (found by review).
    expect(InvalidRequestError, lambda: model.new_sampler(SamplingParams(top_k=-(2**32) + 1)))
    expect(InvalidRequestError, lambda: model.new_sampler(SamplingParams(repeat_last_n=2**32)))
    expect(InvalidRequestError, lambda: model.new_sampler(SamplingParams(repeat_last_n=-2)))
    expect(InvalidRequestError, lambda: model.new_sampler(SamplingParams(seed=2**32)))
    model.new_sampler(SamplingParams(top_k=2**31 - 1, seed=2**32 - 1)).close()
    model.new_sampler(SamplingParams(top_k=-(2**31))).close()  # <= 0: top-k off


def case_no_logits(backend: str) -> None:
    model = load(backend)
    ctx = model.new_context(P)
    sampler = model.new_sampler(SamplingParams(temperature=0))
    expect(NoLogitsError, ctx.logits)
    expect(NoLogitsError, lambda: sampler.sample(ctx, -1))
    tokens = model.tokenize(PROMPT)
    ctx.decode([BatchToken(t, i, 0, logits=False) for i, t in enumerate(tokens[:4])])
    expect(NoLogitsError, lambda: ctx.logits(-1))
    expect(NoLogitsError, lambda: sampler.sample(ctx, 0))
    ctx.decode([BatchToken(tokens[4], 4, 0, logits=True)])
    expect(NoLogitsError, lambda: ctx.logits(1))
    assert len(ctx.logits(0)) == model.facts.n_vocab


def case_use_after_close(backend: str) -> None:
    model = load(backend)
    ctx = model.new_context(P)
    sampler = model.new_sampler(SamplingParams(temperature=0))
    ctx.prefill(0, model.tokenize(PROMPT), 0)
    blob = ctx.kv_pack(0)
    sampler.close()
    sampler.close()
    expect(HandleClosedError, lambda: sampler.sample(ctx, -1))
    expect(HandleClosedError, lambda: sampler.accept(1))
    ctx.close()
    ctx.close()
    expect(HandleClosedError, ctx.logits)
    expect(HandleClosedError, lambda: ctx.prefill(0, [1, 2], 0))
    expect(HandleClosedError, lambda: ctx.kv_unpack(0, blob))
    expect(HandleClosedError, lambda: ctx.kv_pack(0))
    expect(HandleClosedError, lambda: ctx.seq_pos_max(0))
    model.close()
    model.close()
    expect(HandleClosedError, lambda: model.tokenize("x"))
    expect(HandleClosedError, lambda: model.new_context(P))
    expect(HandleClosedError, lambda: model.new_sampler(SamplingParams()))
    expect(HandleClosedError, lambda: model.facts)


def case_close_model_with_open_context(backend: str) -> None:
    model = load(backend)
    ctx = model.new_context(P)
    sampler = model.new_sampler(SamplingParams(temperature=0))
    tokens = model.tokenize(PROMPT)
    model.close()  # deferred: the context and sampler still hold the model
    expect(HandleClosedError, lambda: model.tokenize("x"))
    ctx.prefill(0, tokens, 0)
    token = sampler.sample(ctx, -1)
    ctx.decode([BatchToken(token, len(tokens), 0, True)])
    sampler.close()
    ctx.close()  # the last dependent: the model is freed here, once
    expect(HandleClosedError, ctx.logits)


def case_out_of_range_ids(backend: str) -> None:
    model = load(backend)
    ctx = model.new_context(P)
    n_vocab = model.facts.n_vocab
    for bad in (-1, n_vocab, 2**31 - 1):
        expect(InvalidRequestError, lambda bad=bad: ctx.prefill(0, [1, bad], 0))
        expect(InvalidRequestError, lambda bad=bad: ctx.decode([BatchToken(bad, 0, 0, True)]))
        expect(InvalidRequestError, lambda bad=bad: model.detokenize([bad]))
        expect(InvalidRequestError, lambda bad=bad: model.token_to_piece(bad))
        expect(InvalidRequestError, lambda bad=bad: model.is_eog(bad))
    # Found by review: non-integer ids passed the range checks and failed in ctypes/min().
    for bad in (1.5, "7", None, True):
        expect(InvalidRequestError, lambda bad=bad: ctx.prefill(0, [1, bad], 0))
        expect(InvalidRequestError, lambda bad=bad: ctx.decode([BatchToken(bad, 0, 0, True)]))
        expect(InvalidRequestError, lambda bad=bad: ctx.decode([BatchToken(1, bad, 0, True)]))
        expect(InvalidRequestError, lambda bad=bad: model.detokenize([1, bad]))
        expect(InvalidRequestError, lambda bad=bad: model.token_to_piece(bad))
        expect(InvalidRequestError, lambda bad=bad: model.is_eog(bad))
    for seq in (-1, P.n_seq_max, 1000):
        expect(InvalidRequestError, lambda seq=seq: ctx.prefill(seq, [1, 2], 0))
        expect(InvalidRequestError, lambda seq=seq: ctx.decode([BatchToken(1, 0, seq, True)]))
        expect(InvalidRequestError, lambda seq=seq: ctx.kv_pack(seq))
        expect(InvalidRequestError, lambda seq=seq: ctx.kv_unpack(seq, b"x" * 64))
        expect(InvalidRequestError, lambda seq=seq: ctx.seq_rm(seq))
        expect(InvalidRequestError, lambda seq=seq: ctx.seq_cp(0, seq))
        expect(InvalidRequestError, lambda seq=seq: ctx.seq_pos_max(seq))
    tokens = model.tokenize(PROMPT)
    ctx.prefill(0, tokens[:5], 0)
    expect(InvalidRequestError, lambda: ctx.prefill(0, tokens[5:], 7))  # leaves a gap
    expect(InvalidRequestError, lambda: ctx.decode([BatchToken(tokens[5], 3, 0, True)]))
    expect(InvalidRequestError, lambda: ctx.decode([]))
    expect(
        InvalidRequestError,
        lambda: ctx.decode([BatchToken(1, 5 + i, 0) for i in range(P.n_batch + 1)]),
    )
    sampler = model.new_sampler(SamplingParams(temperature=0))
    expect(InvalidRequestError, lambda: sampler.accept(n_vocab))
    expect(InvalidRequestError, lambda: sampler.sample_logits(b"\0" * 12))


def case_bad_grammar(backend: str) -> None:
    model = load(backend)
    for grammar in ("", "this is not gbnf", 'start ::= "x"', "root ::= undefined-rule"):
        expect(GrammarError, lambda g=grammar: model.new_sampler(SamplingParams(grammar=g)))
    # Found by review: llama.cpp takes C strings, so it compiled 'root ::= "x"' from this one
    # and enforced "x" alone, or found rule "root" for the root "root<NUL>x".
    expect(GrammarError, lambda: model.new_sampler(SamplingParams(grammar='root ::= "x"\0 | "y"')))
    expect(
        GrammarError,
        lambda: model.new_sampler(SamplingParams(grammar='root ::= "x"', grammar_root="root\0x")),
    )


def case_deep_grammar(backend: str) -> None:
    """llama.cpp's grammar parser recurses once per nested group: 200,000 of them overflowed
    its stack (a segfault) when a sampler was made outside the engine's request checks."""
    model = load(backend)
    deep = "root ::= " + "(" * 200_000 + '"a"' + ")" * 200_000
    expect(GrammarError, lambda: model.new_sampler(SamplingParams(temperature=0, grammar=deep)))
    nested = "root ::= " + "(" * 50 + '"a"' + ")" * 50  # what llama.cpp parses still compiles
    model.new_sampler(SamplingParams(temperature=0, grammar=nested)).close()


def case_token_level_grammar(backend: str) -> None:
    """llama.cpp's grammar admitted a token spanning a literal's end and a negated token
    element (``"a" !<[28]>``: SmolLM2's ``anto``), then threw on accepting it: a C++
    exception through the C API, which aborted the process (found by review). Token-level
    elements are refused; a ``<`` in a literal, a class or a comment is text."""
    model = load(backend)
    for grammar in (
        'root ::= "a" !<[28]>',
        "root ::= <[28]>",
        'root ::= "x" <|im_end|>',
        'root ::= ("a" | !<[1]>)*',
    ):
        expect(GrammarError, lambda g=grammar: model.new_sampler(SamplingParams(grammar=g)))
    text = 'root ::= "<[28]>" [<>] # <not a token>\n'
    model.new_sampler(SamplingParams(temperature=0, grammar=text)).close()


def case_left_recursion_through_an_empty_rule(backend: str) -> None:
    """llama.cpp refuses ``y? root`` at the start of ``root`` but not ``y root`` where ``y``
    can match nothing: its grammar compile never returned (found by review)."""
    model = load(backend)
    for grammar in ('root ::= y root "b" | "a"\ny ::= "x"?', 'root ::= (y) root | "a"\ny ::= ""'):
        expect(GrammarError, lambda g=grammar: model.new_sampler(SamplingParams(grammar=g)))
    fine = 'root ::= y "b" root | "a"\ny ::= "x"?'  # the recursion after a part: not left
    model.new_sampler(SamplingParams(temperature=0, grammar=fine)).close()


def case_repeat_below_its_least(backend: str) -> None:
    """llama.cpp's grammar parser counts ``{m,n}``'s optional repeats as ``n - m`` unsigned: on
    ``{5,2}`` it added rules until the kernel killed the process (found by fuzzing the
    server). Under a bound on the address space the old code died here at once (an uncaught
    ``bad_alloc``) instead of taking the machine's memory with it."""
    model = load(backend)
    with _memory_bounded():
        for grammar in ('root ::= "a"{5,2}', 'root ::= ("a" | "b"){3, 0}'):
            expect(GrammarError, lambda g=grammar: model.new_sampler(SamplingParams(grammar=g)))
        model.new_sampler(SamplingParams(temperature=0, grammar='root ::= "a"{2,5}')).close()


@contextmanager
def _memory_bounded(extra: int = 2 << 30) -> Iterator[None]:
    """The process's address space bounded to what it uses now and ``extra`` more, for the
    block only: the stub's cases run in the test process itself, whose every later allocation
    a bound left behind would fail (found: a whole run then failed at random and aborted)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        used = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def case_grammar_after_a_comment_ended_by_a_carriage_return(backend: str) -> None:
    """llama.cpp's grammar parser ends a comment at a CR as at an LF and compiles what follows
    the CR; kvwarm's checks ended it at LF alone, so a group nesting 200,000 deep (a segfault)
    or a ``{5,2}`` (rules until out of memory) after ``# ...\\r`` reached llama.cpp unchecked
    (found by review). Memory is bounded as in ``case_repeat_below_its_least``."""
    model = load(backend)
    with _memory_bounded():
        for grammar in (
            'root ::= "a" # a comment\rx ::= "a"{5,2}\n',
            'root ::= "a" # a comment\rx ::= ' + "(" * 200_000 + '"a"' + ")" * 200_000,
        ):
            expect(GrammarError, lambda g=grammar: model.new_sampler(SamplingParams(grammar=g)))
        fine = 'root ::= "a" # a comment {5,2} ((((\rx ::= "b"\n'
        model.new_sampler(SamplingParams(temperature=0, grammar=fine)).close()


def case_repetition_past_llama_cpps_bound(backend: str) -> None:
    """llama.cpp's grammar parser reads a repetition's most past 2,000 as no most at all:
    ``"a"{0,5000}`` compiled as ``"a"*``, a grammar that let the model write any number of
    letters (found by review, by feeding the compiled grammar 6,000 of them). Refused."""
    model = load(backend)
    for grammar in ('root ::= "a"{0,5000}', 'root ::= "a"{3,2001} "b"'):
        expect(GrammarError, lambda g=grammar: model.new_sampler(SamplingParams(grammar=g)))
    model.new_sampler(SamplingParams(temperature=0, grammar='root ::= "a"{0,2000}')).close()


def case_grammar_then_accept(backend: str) -> None:
    # accept() feeds penalty history only: a token the grammar forbids must not reach it.
    model = load(backend)
    sampler = model.new_sampler(SamplingParams(temperature=0, grammar='root ::= "yes"'))
    n_vocab = model.facts.n_vocab
    logits = bytearray(n_vocab * 4)  # all zeros: the grammar picks among its allowed tokens
    first = sampler.sample_logits(bytes(logits))
    assert not model.is_eog(first)
    sampler.accept(first)
    sampler.accept(model.facts.eos or 0)  # an EOS mid-grammar would abort inside llama.cpp
    assert not model.is_eog(sampler.sample_logits(bytes(logits)))


def case_bad_adapter(backend: str) -> None:
    model = load(backend)
    expect(AdapterError, lambda: model.load_adapter("/nonexistent/adapter.gguf"))
    path = f"/tmp/kvwarm-bad-adapter-{os.getpid()}.gguf"
    with open(path, "wb") as fh:
        fh.write(b"GGUF" + os.urandom(256))
    try:
        if backend == "stub":
            model.load_adapter(path).close()  # the stub accepts any readable file
        else:
            expect(AdapterError, lambda: model.load_adapter(path))
    finally:
        os.unlink(path)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    CASES[sys.argv[2]](sys.argv[1])
    print("CASE-OK")
