"""Stub-only properties other components' tests rely on."""

from __future__ import annotations

import struct

import pytest

from kvwarm.backends.base import ContextParams, SamplingParams
from kvwarm.backends.stub import EOS, OFFSET, StubBackend
from kvwarm.errors import GrammarError, StateRestoreError

P = ContextParams(n_ctx=128, n_batch=16, n_ubatch=16, n_seq_max=2)


def test_deterministic_across_instances() -> None:
    def run() -> tuple[bytes, bytes]:
        model = StubBackend().load_model("m")
        ctx = model.new_context(P)
        ctx.prefill(0, model.tokenize("same prompt"), 0)
        return bytes(ctx.logits()), ctx.kv_pack(0)

    assert run() == run()


def test_blob_depends_on_model_and_prefix() -> None:
    backend = StubBackend()
    a = backend.load_model("a").new_context(P)
    b = backend.load_model("b").new_context(P)
    a.prefill(0, [OFFSET + 1, OFFSET + 2], 0)
    with pytest.raises(StateRestoreError):
        b.kv_unpack(0, a.kv_pack(0))
    blob = bytearray(a.kv_pack(0))
    struct.pack_into("<i", blob, len(blob) - 32 + 4, OFFSET + 9)  # change the last token
    with pytest.raises(StateRestoreError):
        a.kv_unpack(1, blob)


def test_cell_bytes_sets_blob_size() -> None:
    small = StubBackend(cell_bytes=16).load_model("m").new_context(P)
    big = StubBackend(cell_bytes=1024).load_model("m").new_context(P)
    for ctx in (small, big):
        ctx.prefill(0, list(range(OFFSET, OFFSET + 10)), 0)
    assert len(big.kv_pack(0)) - len(small.kv_pack(0)) == 10 * (1024 - 16)


def test_exclamation_mark_ends_generation() -> None:
    model = StubBackend().load_model("m")
    ctx = model.new_context(P)
    ctx.prefill(0, model.tokenize("wow!"), 0)
    sampler = model.new_sampler(SamplingParams(temperature=0))
    assert sampler.sample(ctx, -1) == EOS


def test_literal_grammar_is_enforced_and_others_checked() -> None:
    model = StubBackend().load_model("m")
    ctx = model.new_context(P)
    ctx.prefill(0, model.tokenize("q"), 0)
    logits = bytes(ctx.logits())
    sampler = model.new_sampler(SamplingParams(temperature=0, grammar='root ::= "ok"'))
    out = [sampler.sample_logits(logits) for _ in range(3)]
    assert out == [OFFSET + ord("o"), OFFSET + ord("k"), EOS]
    with pytest.raises(GrammarError):
        model.new_sampler(SamplingParams(grammar='root ::= item\nitem ::= "x" other'))
    # Rule names as llama.cpp reads them (a JSON schema's property "" has the rule "-kv"):
    # the stub refused them as undefined rules (found by fuzzing).
    for names in ('root ::= -kv x_y 1\n-kv ::= "a"\nx_y ::= "b"\n1 ::= "c"',):
        model.new_sampler(SamplingParams(grammar=names)).close()


def test_the_environment_sets_a_stub_backends_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes a test does not construct (a cluster's replicas) get the stub's simulated
    latency from the environment; a bad value is refused, not ignored."""
    from kvwarm.backends import get_backend
    from kvwarm.errors import ConfigError

    monkeypatch.setenv("KVWARM_STUB_DECODE_DELAY_S", "0.02")
    backend = get_backend("stub")
    assert isinstance(backend, StubBackend)
    assert (backend.prefill_delay_s, backend.decode_delay_s) == (0.0, 0.02)
    for bad in ("-1", "nan", "soon"):
        monkeypatch.setenv("KVWARM_STUB_PREFILL_DELAY_S", bad)
        with pytest.raises(ConfigError, match="KVWARM_STUB_PREFILL_DELAY_S"):
            StubBackend.from_env()
