"""OpenAI wire shapes <-> engine types: options in, responses, chunks and usage out.

Invariant: every response reports ``usage.prompt_tokens_details.cached_tokens`` from the
engine's ``CompletionStats.cached_tokens`` (the prompt tokens restored from the cache), and the
engine's own options type validates values, so the server never re-implements range checks.
"""

from __future__ import annotations

import codecs
import dataclasses
import re
import secrets
import time
from collections.abc import Mapping, Sequence

from kvwarm.cache.explain import reuse_json
from kvwarm.engine.text import piece_bytes
from kvwarm.engine.types import (
    SAMPLING_OPTIONS,
    Completion,
    CompletionStats,
    GenerationOptions,
    TokenLogprob,
)
from kvwarm.errors import InvalidRequestError
from kvwarm.server.errors import HTTPError, rename_param
from kvwarm.server.schemas import LineStops, ResponseFormat, SamplingFields
from kvwarm.server.tools import CallGrammar, ToolCall

Json = dict[str, object]

_TOKEN_ID = re.compile(r"[0-9]{1,10}", re.ASCII)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def response_schema(fmt: ResponseFormat | None) -> dict[str, object] | None:
    """The JSON schema a response_format asks for (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else fmt.schema_
    if schema is None:
        raise HTTPError(
            400,
            "response_format json_schema needs a schema",
            code="invalid_value",
            param="response_format.json_schema",
        )
    return schema


def options(
    req: SamplingFields,
    *,
    default_max_tokens: int,
    max_tokens_limit: int,
    over_limit: str,
    max_tokens: int | None = None,
    json_schema: Mapping[str, object] | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    cache_salt: str | None = None,
    lora: tuple[tuple[int, float], ...] | None = None,
    names: Mapping[str, str] | None = None,
    calls: CallGrammar | None = None,
    preserved: tuple[str, ...] = (),
    prediction: str | None = None,
) -> GenerationOptions:
    """``req``'s engine options; ``cache_salt`` is the one ``server.tenancy`` resolved (the
    body's field is only one of its inputs), ``lora`` the adapters ``server.lora`` chose;
    ``over_limit``: what a length above ``max_tokens_limit`` gets (``length_within``).
    ``names``: the client's name of a field another API spells otherwise (Anthropic's
    ``stop_sequences`` for ``stop``), so an error about it names what the client sent.
    ``calls``: tool_choice auto's call grammar (``chat.call_grammar``), unless the request
    constrains the whole reply itself (``grammar``, a response format). ``preserved``: the
    special tokens whose text the reply keeps (``ChatPlan.preserved``: tool-call markers).
    ``prediction``: chat's predicted output, as text (``GenerationOptions.prediction``).
    A body that takes llama-server's line stops (``LineStops``) brings them too."""
    # Every stop string as sent: an empty one is the engine's 400 naming the field
    # (``GenerationOptions.validate``), not a string silently dropped.
    stop: tuple[str, ...] = ()
    if isinstance(req.stop, str):
        stop = (req.stop,)
    elif req.stop:
        stop = tuple(req.stop)
    if json_schema is not None and req.grammar is not None:
        # Named by both spellings: /completion and /infill take the schema as json_schema
        # (found by review: their refusal named response_format, a field they do not have).
        raise HTTPError(
            400,
            "give grammar or a JSON schema (response_format, json_schema), not both",
            code="invalid_value",
            param="grammar",
        )
    bias: dict[int, float] | None = None
    if req.logit_bias:
        # A key is a token id's decimal digits: Python's int() also read "1_0" as 10, " 7 "
        # as 7 and "٣" (Arabic-Indic three) as 3 (found by review).
        bad = [token for token in req.logit_bias if not _TOKEN_ID.fullmatch(token)]
        if bad:
            raise HTTPError(
                400,
                f"logit_bias keys must be token ids (decimal digits), not {bad[0]!r}",
                code="invalid_value",
                param="logit_bias",
            )
        bias = {int(token): float(value) for token, value in req.logit_bias.items()}
    for param in ("max_tokens", "max_completion_tokens"):  # each length field the client sent
        length_within(getattr(req, param, None), param, max_tokens_limit, over_limit)
    chosen = max_tokens if max_tokens is not None else req.max_tokens
    chosen = default_max_tokens if chosen is None else chosen
    overrides: dict[str, object] = {
        "max_tokens": min(chosen, max_tokens_limit),
        "stop": stop,
        # llama.cpp seeds are 32-bit (and -1 wraps to its "random" seed, as in its server).
        "seed": None if req.seed is None else req.seed & 0xFFFFFFFF,
        "grammar": req.grammar,
        "json_schema": json_schema,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "logit_bias": bias,
        "ignore_eos": req.ignore_eos,
        "cache_salt": cache_salt,
        "spec_type": req.spec_type,
        "spec_draft_max": req.spec_draft_max,
        "lora": lora,
        "preserved_tokens": preserved,
        "prediction": prediction,
    }
    if calls is not None and json_schema is None and req.grammar is None:
        overrides |= {
            "grammar": calls.grammar,
            "grammar_triggers": calls.triggers,
            "grammar_start_patterns": calls.starts,
            # A reply that may not end (ignore_eos) is free again after its call instead.
            "grammar_once": calls.once and not req.ignore_eos,
        }
    if isinstance(req, LineStops):  # 0 or below is off, as llama-server reads them
        overrides["n_indent"] = max(0, req.n_indent)
        overrides["t_max_predict_ms"] = max(0, req.t_max_predict_ms)
    for name in SAMPLING_OPTIONS:
        value = getattr(req, name)
        if value is not None:
            overrides[name] = value
    opts = dataclasses.replace(GenerationOptions(), **overrides)  # type: ignore[arg-type]
    try:
        opts.validate()
    except InvalidRequestError as exc:
        rename_param(exc, {**req.sent_as(), **(names or {})})
        raise
    return opts


def length_within(value: object, param: str, limit: int, over_limit: str) -> None:
    """A length field the client sent (``param``) above the server's ``max_tokens_limit``: a
    400 naming it with ``over_limit`` "refuse"; with "cap" (the default, as llama-server's
    ``-n`` caps ``n_predict``) the request is served up to the limit, its reply ending as at
    its own ``max_tokens`` (finish reason ``length``): clients that ask for a model's whole
    output budget (Claude Code's 32,000) are served."""
    if isinstance(value, int) and value > limit and over_limit == "refuse":
        raise HTTPError(
            400,
            f"{param} is {value}, above this server's limit of {limit} "
            "(setting max_tokens_limit; max_tokens_over_limit = cap serves it up to the limit)",
            param=param,
            code="invalid_value",
        )


def usage(stats: CompletionStats) -> Json:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def timings(stats: CompletionStats) -> Json:
    """kvwarm's extension, with llama-server's ``timings`` fields under its names."""
    prefilled = max(stats.prompt_tokens - stats.cached_tokens, 0)
    return {
        "queue_ms": round(stats.queue_ms, 3),
        "prefill_ms": round(stats.prefill_ms, 3),
        "generation_ms": round(stats.generation_ms, 3),
        "cache_hit": stats.cache_hit,
        "cached_tokens": stats.cached_tokens,
        # The finish save's row key (None: not saved): its file is ``<key>.kvc`` in a disk tier.
        "cache_key": stats.key.hex() if stats.key else None,
        "cache_reason": None if stats.reuse is None else reuse_json(stats.reuse),
        # Speculative decoding, under llama-server's names: tokens drafted, and accepted.
        "draft_n": stats.drafted_tokens,
        "draft_n_accepted": stats.accepted_tokens,
        # The prompt's pass under llama-server's names (found by review: a llama-server
        # client reading timings.prompt_n, as llama.vim and llama-server's web page do, found
        # none): tokens reused, tokens prefilled, and the prefill's time.
        "cache_n": stats.cached_tokens,
        "prompt_n": prefilled,
        "prompt_ms": round(stats.prefill_ms, 3),
        "prompt_per_token_ms": round(_per(stats.prefill_ms, prefilled), 3),
        "prompt_per_second": round(_per(prefilled * 1e3, stats.prefill_ms), 3),
        # The decode steps alone, as llama-server times them: tokens sampled (an end of
        # generation included), ms from the first one's sampling to the last one's, and the
        # tokens after the first a second over that time.
        "predicted_n": stats.sampled_tokens,
        "predicted_ms": round(stats.decode_ms, 3),
        "predicted_per_token_ms": round(_per(stats.decode_ms, stats.decode_steps), 3),
        "predicted_per_second": round(stats.decode_per_second, 3),
    }


def _per(amount: float, count: float) -> float:
    """``amount / count``, 0 where ``count`` is not positive (llama-server's rates then)."""
    return amount / count if count > 0 else 0.0


def finish_reason(stats: CompletionStats, calls: bool = False) -> str:
    """OpenAI's finish reason. A reply max_tokens cut off is ``length`` even when calls
    came before the cut (issue 41: its second call, never closed, was dropped and the reply
    said ``tool_calls``, as if complete)."""
    if stats.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def chat_logprobs(items: Sequence[TokenLogprob] | None) -> Json | None:
    if items is None:
        return None
    return {"content": token_logprobs(items)}


def token_logprobs(items: Sequence[TokenLogprob], *, ids: bool = False) -> list[Json]:
    """Each token's text, logprob, bytes and top alternatives (OpenAI chat's ``content``);
    ``ids``: with each token's ``id`` too (llama-server's ``completion_probabilities``)."""

    def one(token: int, text: str, logprob: float) -> Json:
        out: Json = {"id": token} if ids else {}
        return out | {"token": text, "logprob": logprob, "bytes": list(piece_bytes(text))}

    return [
        one(t.token, t.text, t.logprob) | {"top_logprobs": [one(*top) for top in t.top]}
        for t in items
    ]


class TextOffsets:
    """Character offsets of successive tokens in the decoded text. A token holding part of a
    character moves the offset only once the character is whole."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, text: str) -> int:
        """The offset of a token with this (``piece_text``) text; advances past it."""
        at = self.offset
        self.offset += len(self._decoder.decode(piece_bytes(text)))
        return at


def completion_logprobs(
    items: Sequence[TokenLogprob] | None,
    offsets: TextOffsets,
    prompt: PromptLogprobs | None = None,
) -> Json | None:
    """OpenAI's completions ``logprobs``; with ``prompt`` (echo), the prompt's tokens first,
    the very first of them with a null logprob, as OpenAI reports it."""
    if items is None and prompt is None:
        return None
    tokens: list[str] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    at: list[int] = []
    if prompt is not None:
        tokens.append(prompt.first)
        logprobs.append(None)
        tops.append(None)
        at.append(offsets.take(prompt.first))
    for t in [*(prompt.rest if prompt is not None else ()), *(items or ())]:
        tokens.append(t.text)
        logprobs.append(t.logprob)
        # Best first: of two tokens of one text (Gemma's byte token <0x0A> and its "\n"), the
        # better one's logprob, not the later one's (found by review: it overwrote it).
        top: dict[str, float] = {}
        for _, text, lp in t.top:
            top.setdefault(text, lp)
        # OpenAI's: "the API will always return the logprob of the sampled token, so there may
        # be up to logprobs+1 elements" (vLLM's too). Found by review: a sampled token outside
        # the best ``logprobs`` was missing, and ``logprobs: 0`` gave every token ``{}``. Last,
        # so a better token of the same text keeps its entry.
        top.setdefault(t.text, t.logprob)
        tops.append(top)
        at.append(offsets.take(t.text))
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": at}


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """An echoed prompt's logprobs: its first token (text only) and the rest."""

    first: str
    rest: Sequence[TokenLogprob]


class ResponseIds:
    """The id/created/model triple shared by a response and all its chunks."""

    def __init__(self, prefix: str, model: str) -> None:
        self.id = new_id(prefix)
        self.created = int(time.time())
        self.model = model

    def head(self, obj: str) -> Json:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "kvwarm",
        }


def chat_choice(
    index: int, done: Completion, content: str | None, calls: Sequence[ToolCall]
) -> Json:
    message: Json = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(done.logprobs),
        "finish_reason": finish_reason(done.stats, bool(calls)),
    }


def chat_response(ids: ResponseIds, choices: Sequence[Json], stats: CompletionStats) -> Json:
    return {
        **ids.head("chat.completion"),
        "choices": list(choices),
        "usage": usage(stats),
        "timings": timings(stats),
    }


def chat_chunk(
    ids: ResponseIds,
    delta: Json,
    finish: str | None = None,
    *,
    index: int = 0,
    logprobs: Json | None = None,
    with_usage: bool = False,
) -> Json:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    chunk: Json = {**ids.head("chat.completion.chunk"), "choices": [choice]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(ids: ResponseIds, obj: str, stats: CompletionStats) -> Json:
    return {**ids.head(obj), "choices": [], "usage": usage(stats), "timings": timings(stats)}


def text_choice(index: int, text: str, done: Completion, logprobs: Json | None) -> Json:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(done.stats),
    }


def text_chunk(
    ids: ResponseIds,
    text: str,
    finish: str | None,
    *,
    index: int = 0,
    logprobs: Json | None = None,
    with_usage: bool,
) -> Json:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    chunk: Json = {**ids.head("text_completion"), "choices": [choice]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def sum_stats(all_stats: Sequence[CompletionStats]) -> CompletionStats:
    """One usage for a multi-prompt completion request."""
    first = all_stats[0]
    return dataclasses.replace(
        first,
        prompt_tokens=sum(s.prompt_tokens for s in all_stats),
        cached_tokens=sum(s.cached_tokens for s in all_stats),
        completion_tokens=sum(s.completion_tokens for s in all_stats),
        prefill_ms=sum(s.prefill_ms for s in all_stats),
        generation_ms=sum(s.generation_ms for s in all_stats),
        queue_ms=sum(s.queue_ms for s in all_stats),
        drafted_tokens=sum(s.drafted_tokens for s in all_stats),
        accepted_tokens=sum(s.accepted_tokens for s in all_stats),
        sampled_tokens=sum(s.sampled_tokens for s in all_stats),
        decode_steps=sum(s.decode_steps for s in all_stats),
        decode_ms=sum(s.decode_ms for s in all_stats),
    )
