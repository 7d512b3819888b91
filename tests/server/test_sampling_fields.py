"""How the server turns the engine's sampling results into OpenAI's shapes."""

from __future__ import annotations

from kvwarm.engine.types import TokenLogprob
from kvwarm.server.convert import TextOffsets, completion_logprobs


def test_completions_top_logprobs_keep_the_best_of_tokens_of_one_text() -> None:
    """Completions' ``top_logprobs`` is a text -> logprob object; two alternatives of one
    text (Gemma 3 has 110 such texts: its byte token <0x0A> and "\\n", 6250 unused tokens of
    no text) are one entry, whose logprob is the better one's, as the list is best first
    (found by review: the worse one overwrote it)."""
    top = ((10, "\n", -0.5), (11, "a", -1.0), (12, "\n", -3.0), (13, "", -4.0), (14, "", -5.0))
    item = TokenLogprob(10, "\n", -0.5, top)
    out = completion_logprobs([item], TextOffsets())
    assert out is not None
    assert out["top_logprobs"] == [{"\n": -0.5, "a": -1.0, "": -4.0}]


def test_completions_top_logprobs_hold_the_sampled_token() -> None:
    """OpenAI's completions ``logprobs``: "the API will always return the logprob of the
    sampled token, so there may be up to logprobs+1 elements" (vLLM's too). Found by review:
    a token sampled outside the best ``logprobs`` was missing from its ``top_logprobs``, and
    ``logprobs: 0`` answered ``{}`` for every token."""
    sampled = TokenLogprob(12, "c", -3.0, ((10, "a", -0.5), (11, "b", -1.0)))
    best = TokenLogprob(10, "a", -0.5, ((10, "a", -0.5), (11, "b", -1.0)))
    bare = TokenLogprob(11, "b", -1.0)  # logprobs: 0, no alternatives
    out = completion_logprobs([sampled, best, bare], TextOffsets())
    assert out is not None
    assert out["top_logprobs"] == [
        {"a": -0.5, "b": -1.0, "c": -3.0},
        {"a": -0.5, "b": -1.0},
        {"b": -1.0},
    ]
    # A better token of the same text keeps its entry: the object holds one entry a text.
    byte = TokenLogprob(20, "\n", -4.0, ((21, "\n", -0.25),))
    out = completion_logprobs([byte], TextOffsets())
    assert out is not None and out["top_logprobs"] == [{"\n": -0.25}]
