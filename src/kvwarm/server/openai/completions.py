"""``/v1/completions`` (``n`` choices, ``best_of`` candidates, ``echo`` with prompt logprobs,
``suffix``) and llama-server's ``/infill`` and ``/completion`` (``/completions``), which answer
in llama-server's shape (``_llama_body``, ``_llama_chunks``).

Invariants: as every route (``server/generate.py``: the event loop never blocks on the engine).
Choice ``j`` of prompt ``i`` has index ``i * n + j``. ``echo`` with ``logprobs`` prefills the
prompt with logits at every position (no KV reuse) and reports the first prompt token with a
null logprob, as OpenAI does. ``best_of`` generates that many choices (forks, as ``n``'s) and
returns the ``n`` with the highest mean logprob per token, best first; usage counts every
candidate. A ``suffix`` or an ``/infill`` on a model without FIM tokens is a
400 ``fim_not_supported`` (``engine/prompts.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvwarm.engine.prompts import ExtraFile
from kvwarm.engine.text import piece_text as text_of
from kvwarm.engine.types import Completion, GenerationOptions, TokenLogprob
from kvwarm.errors import InvalidRequestError
from kvwarm.server import convert, tenancy
from kvwarm.server.errors import HTTPError, rename_param
from kvwarm.server.generate import SSE_HEADERS, sse
from kvwarm.server.openai.choices import Choices, best_of, group_stats
from kvwarm.server.schemas import (
    CompletionRequest,
    InfillRequest,
    LlamaCompletionRequest,
    LlamaFields,
    check_count,
    check_sampling,
    json_body,
    lora_pairs,
    parse_body,
    read_json,
)
from kvwarm.server.state import ServerState, server_state

if TYPE_CHECKING:
    from kvwarm.server.lora import LoraChoice
    from kvwarm.server.served import ServedModel

router = APIRouter()

Prompt = str | list[int]
_Req = TypeVar("_Req", CompletionRequest, LlamaCompletionRequest)


async def _read_prompts(request: Request, state: ServerState, schema: type[_Req]) -> _Req:
    """A completion request's body: its prompts counted against ``max_completion_prompts``
    before it is parsed, its sampling checked."""
    body = await read_json(request, state.settings)
    check_count(body, "prompt", state.settings.max_completion_prompts, "max_completion_prompts")
    req = parse_body(body, schema)
    check_sampling(req)
    return req


def _prompts(
    prompt: str | list[str] | list[int] | list[list[int]] | list[str | list[int]],
) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise HTTPError(400, "prompt must not be empty", code="invalid_value", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    out: list[Prompt] = []
    for p in prompt:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list):
            out.append(list(p))
    return out


async def _fim_prompts(model: ServedModel, prompts: list[Prompt], suffix: str) -> list[Prompt]:
    """Each prompt as the prefix of a fill-in-the-middle prompt ending at ``suffix``."""
    out: list[Prompt] = []
    for prompt in prompts:
        # Off the loop: a cluster's model answers through a blocking replica call.
        prefix = (
            prompt if isinstance(prompt, str) else await run_in_threadpool(model.detokenize, prompt)
        )
        out.append(await run_in_threadpool(model.infill_tokens, prefix, suffix))
    return out


async def _echo_text(model: ServedModel, req: CompletionRequest, prompt: Prompt) -> str:
    if not req.echo:
        return ""
    if isinstance(prompt, str):
        return prompt
    return await run_in_threadpool(model.detokenize, prompt)


async def _prompt_part(
    model: ServedModel,
    prompt: Prompt,
    parse_special: bool,
    tokens: Sequence[int],
    rest: Sequence[TokenLogprob] | None,
) -> convert.PromptLogprobs:
    """An echoed prompt's logprobs: the first token (text only), then the engine's; a special
    token the prompt's text holds has that text (``_special_texts``)."""
    first = await run_in_threadpool(model.detokenize, list(tokens[:1]))
    texts = [first, *(t.text for t in rest or ())]
    special = await run_in_threadpool(_special_texts, model, prompt, parse_special, tokens)
    for at, text in special.items():
        if at < len(texts) and not texts[at]:
            texts[at] = text
    kept = tuple(
        t if t.text == text else dataclasses.replace(t, text=text)
        for t, text in zip(rest or (), texts[1:], strict=False)
    )
    return convert.PromptLogprobs(texts[0], kept)


def _special_texts(
    model: ServedModel, prompt: Prompt, parse_special: bool, tokens: Sequence[int]
) -> dict[int, str]:
    """Position -> text of each special token an echoed text prompt holds as its text. Found
    by review: a token's text is its piece without special tokens' (they are no text of a
    reply), so "<|im_start|>" echoed as written had the token text "", the tokens no longer
    joined to the echoed text and every later ``text_offset`` fell short. A token the
    tokenizer added (BOS) is in no text: it stays "". Token ids are echoed as they
    detokenize, special tokens left out: nothing to do."""
    if not isinstance(prompt, str) or not parse_special or not tokens:
        return {}  # (no tokens: a cluster's stream, which carries none)
    bare = model.tokenize(prompt, add_special=False, parse_special=True)
    if not bare:
        return {}
    # The prompt's own tokens, after at most a BOS the tokenizer added.
    start = next((k for k in (0, 1) if list(tokens[k : k + len(bare)]) == bare), None)
    if start is None:
        return {}
    pieces = model.token_pieces(bare)
    return {start + i: text_of(piece) for i, piece in enumerate(pieces) if piece}


@router.post(
    "/v1/completions",
    openapi_extra=json_body(CompletionRequest, streams=True) | tenancy.openapi_header(),
)
async def completions(request: Request) -> Response:
    state = server_state(request)
    req = await _read_prompts(request, state, CompletionRequest)
    _check_best_of(req)
    model, lora = await state.acquire_generation(
        req.model, keep_alive=req.keep_alive, lora=lora_pairs(req.lora)
    )
    candidates = await _candidates(model, req)
    prompts = _prompts(req.prompt)
    if req.suffix is not None:
        if req.echo:
            raise HTTPError(
                400, "echo cannot be combined with suffix", code="invalid_value", param="echo"
            )
        prompts = await _fim_prompts(model, prompts, req.suffix)
    echo_lp = req.echo and req.logprobs is not None
    opts = convert.options(
        req,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_limit=state.settings.max_tokens_limit,
        over_limit=state.settings.max_tokens_over_limit,
        json_schema=convert.response_schema(req.response_format),
        # best_of ranks its candidates by their tokens' logprobs: the chosen ones' at least.
        logprobs=0 if req.logprobs is None and candidates > req.n else req.logprobs,
        prompt_logprobs=req.logprobs if echo_lp else None,
        cache_salt=tenancy.cache_salt(request, req.cache_salt, state.settings),
        lora=lora,
    )
    ids = convert.ResponseIds("cmpl", state.lora.reply_name(req.model, model))
    if req.stream:
        return await _streamed(request, model, req, prompts, opts, ids)
    choices: list[dict[str, object]] = []
    all_stats = []
    for p_index, prompt in enumerate(prompts):
        submit = functools.partial(model.streams, prompt, opts, n=candidates, fragments=False)
        group = await Choices.start(
            request, submit, "completion", model.id, state, user=req.user, names=req.sent_as()
        )
        async with group:
            results = await group.results()
        if group.disconnected:
            break
        text = await _echo_text(model, req, prompt)
        kept = best_of(results, req.n) if candidates > req.n else results
        for j, done in enumerate(kept):
            lp = None
            if req.logprobs is not None:
                part = None
                if echo_lp:
                    part = await _prompt_part(
                        model, prompt, opts.parse_special, done.prompt_tokens, done.prompt_logprobs
                    )
                lp = convert.completion_logprobs(done.logprobs, convert.TextOffsets(), part)
            choices.append(convert.text_choice(p_index * req.n + j, text + done.text, done, lp))
        all_stats.append(group_stats([r.stats for r in results]))
    if not all_stats:
        return Response(status_code=499)
    stats = convert.sum_stats(all_stats)
    body = {
        **ids.head("text_completion"),
        "choices": choices,
        "usage": convert.usage(stats),
        "timings": convert.timings(stats),
    }
    return JSONResponse(body)


def _check_best_of(req: CompletionRequest) -> None:
    """``best_of``'s rules a body alone breaks: fewer than ``n``; more than ``n``, streamed."""
    if req.best_of is None:
        return
    if req.best_of < req.n:
        raise HTTPError(
            400,
            f"best_of ({req.best_of}) must be at least n ({req.n}): it is how many candidates "
            "the n returned are chosen from",
            param="best_of",
            code="invalid_value",
        )
    if req.stream and req.best_of > req.n:
        raise HTTPError(
            400,
            "best_of cannot be streamed: the best candidates are known only once all have finished",
            param="best_of",
            code="invalid_value",
        )


async def _candidates(model: ServedModel, req: CompletionRequest) -> int:
    """How many choices to generate per prompt: ``best_of`` (checked by ``_check_best_of``;
    within the model's slots, as ``n`` is) when it is more than ``n``, else ``n``."""
    if req.best_of is None or req.best_of <= req.n:
        return req.n
    # Off the loop: a cluster's model answers through a blocking replica call.
    slots = (await run_in_threadpool(model.info)).n_parallel
    if req.best_of > slots:
        raise HTTPError(
            400,
            f"best_of must be at most {slots} (this model's n_parallel slots: one per "
            f"candidate); got {req.best_of}",
            param="best_of",
            code="invalid_value",
        )
    return req.best_of


async def _streamed(
    request: Request,
    model: ServedModel,
    req: CompletionRequest,
    prompts: list[Prompt],
    opts: GenerationOptions,
    ids: convert.ResponseIds,
) -> Response:
    """The choices of each prompt in turn, as OpenAI streams a list of prompts: choice ``j``
    of prompt ``i`` is index ``i * n + j``; the usage chunk counts every prompt. Errors
    before the first prompt's first fragment are a status; a later prompt's, an error event."""
    state = server_state(request)

    def start(prompt: Prompt) -> Awaitable[Choices]:
        submit = functools.partial(model.streams, prompt, opts, n=req.n)
        return Choices.start(
            request, submit, "completion", model.id, state, user=req.user, names=req.sent_as()
        )

    current = [await start(prompts[0])]  # the group streaming now, closed however it ends
    await current[0].open_streaming()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events() -> AsyncIterator[dict[str, object]]:
        all_stats = []
        for p_index, prompt in enumerate(prompts):
            if p_index:
                current[0].close()
                current[0] = await start(prompt)
                await current[0].open_streaming()
            group = current[0]
            chunks = _prompt_chunks(model, req, opts, prompt, group, ids, p_index)
            async for chunk in chunks:
                yield chunk
            if group.disconnected:
                return
            all_stats.append(group_stats([r.stats for r in await group.results()]))
        if include_usage:
            yield convert.usage_chunk(ids, "text_completion", convert.sum_stats(all_stats))

    def close() -> None:
        current[0].close()  # the group streaming when the response ends (the earlier: closed)

    return StreamingResponse(
        sse(events(), close),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def _prompt_chunks(
    model: ServedModel,
    req: CompletionRequest,
    opts: GenerationOptions,
    prompt: Prompt,
    group: Choices,
    ids: convert.ResponseIds,
    p_index: int,
) -> AsyncIterator[dict[str, object]]:
    """The chunks of one prompt's choices, interleaved as their fragments arrive."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = p_index * req.n
    text = await _echo_text(model, req, prompt)
    offsets = [convert.TextOffsets() for _ in group.gens]
    for j, gen in enumerate(group.gens):
        if text:
            lp = None
            if req.logprobs is not None:
                stream = gen.stream
                part = await _prompt_part(
                    model, prompt, opts.parse_special, stream.prompt_tokens, stream.prompt_logprobs
                )
                lp = convert.completion_logprobs((), offsets[j], part)
            yield convert.text_chunk(
                ids, text, None, index=base + j, logprobs=lp, with_usage=include_usage
            )
    fed = [False for _ in group.gens]  # whether choice j's fragments carried logprobs
    async for j, fragment in group.merged():
        if fragment is None:
            done = await group.gens[j].result()
            last = None
            if req.logprobs is not None and not fed[j] and done.logprobs:
                # Fragments without logprobs (a cluster replica): they come with the end.
                last = convert.completion_logprobs(done.logprobs, offsets[j])
            reason = convert.finish_reason(done.stats)
            yield convert.text_chunk(
                ids, "", reason, index=base + j, logprobs=last, with_usage=include_usage
            )
            continue
        lp = None
        if req.logprobs is not None:
            fed[j] = fed[j] or bool(fragment.logprobs)
            lp = convert.completion_logprobs(fragment.logprobs, offsets[j])
        yield convert.text_chunk(
            ids, fragment.text, None, index=base + j, logprobs=lp, with_usage=include_usage
        )


# --- /infill (llama-server) ------------------------------------------------------------------


@router.post(
    "/infill", openapi_extra=json_body(InfillRequest, streams=True) | tenancy.openapi_header()
)
async def infill(request: Request) -> Response:
    """llama-server's infill: the middle between ``input_prefix`` (+ ``prompt``) and
    ``input_suffix``, with ``input_extra`` files as context; its response shape, not OpenAI's."""
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), InfillRequest)
    refuse_unsupported(req, _INFILL_IGNORES)
    model, lora = await state.acquire_generation(
        req.model, keep_alive=req.keep_alive, lora=lora_pairs(req.lora)
    )
    if req.n != 1:
        raise HTTPError(400, "/infill makes one completion (n=1)", code="invalid_value", param="n")
    limit, over_limit = state.settings.max_tokens_limit, state.settings.max_tokens_over_limit
    convert.length_within(req.n_predict, "n_predict", limit, over_limit)
    opts = _llama_options(
        request, state, req, lora, json_schema=req.json_schema, logprobs=req.n_probs or None
    )
    # Cut as llama-server cuts (its prefix, suffix and extra files' shares), leaving the
    # context room for this reply (llama-server's: for its server-wide -n).
    extra = [ExtraFile(c.text, c.filename) for c in req.input_extra]
    try:
        tokens = await run_in_threadpool(
            functools.partial(
                model.infill_tokens,
                req.input_prefix,
                req.input_suffix,
                prompt=req.prompt,
                extra=extra,
                n_predict=opts.max_tokens,
            )
        )
    except InvalidRequestError as exc:  # the library's `suffix` is /infill's `input_suffix`
        rename_param(exc, {"suffix": "input_suffix"})
        raise
    submit = functools.partial(model.streams, tokens, opts, n=1, fragments=req.stream)
    group = await Choices.start(
        request, submit, "infill", model.id, state, user=req.user, names=req.sent_as()
    )
    model_id = state.lora.reply_name(req.model, model)
    if not req.stream:
        async with group:
            (done,) = await group.results()
        return JSONResponse(_infill_body(model_id, done, req, opts.max_tokens))
    await group.open_streaming()
    events = _llama_chunks(
        group,
        req,
        lambda _, done: _infill_body(model_id, done, req, opts.max_tokens, streamed=True),
    )
    return StreamingResponse(
        sse(events, group.close, done_line=False),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


def _llama_options(
    request: Request,
    state: ServerState,
    req: LlamaFields,
    lora: LoraChoice | None,
    *,
    logprobs: int | None,
    json_schema: dict[str, object] | None = None,
) -> GenerationOptions:
    """A body in llama-server's shape as generation options: its ``n_predict`` the reply's
    length (-1 or none: the server's default), the rest as every route's."""
    n_predict = req.n_predict
    return convert.options(
        req,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_limit=state.settings.max_tokens_limit,
        over_limit=state.settings.max_tokens_over_limit,
        max_tokens=n_predict if n_predict is not None and n_predict >= 0 else None,
        json_schema=json_schema,
        logprobs=logprobs,
        cache_salt=tenancy.cache_salt(request, req.cache_salt, state.settings),
        lora=lora,
    )


async def _llama_chunks(
    group: Choices,
    req: LlamaFields,
    last: Callable[[int, Completion], Awaitable[dict[str, object]] | dict[str, object]],
    *,
    base: int = 0,
    counts: bool = False,
) -> AsyncIterator[dict[str, object]]:
    """llama-server's stream of one prompt's choices: a ``data:`` chunk per fragment
    (``index``, ``content``, ``stop`` false; with ``counts``, /completion's ``tokens`` and its
    running ``tokens_predicted`` and ``tokens_evaluated``), then each choice's final body
    (``last(index, done)``) as it ends. Choice ``j`` is index ``base + j``. Fragments
    without tokens (a cluster replica streams text only): the choice's tokens and
    probabilities come in one chunk of no text before its final body. Found by review:
    through the ingress every chunk said ``"tokens": []`` and ``n_probs`` gave none."""
    predicted = [0 for _ in group.gens]
    fed = [False for _ in group.gens]  # whether choice j's fragments carried its tokens

    def chunk_of(j: int, text: str, logprobs: Sequence[TokenLogprob]) -> dict[str, object]:
        chunk: dict[str, object] = {"index": base + j, "content": text}
        if counts:
            ids = [t.token for t in logprobs]
            predicted[j] += len(ids)
            chunk["tokens"] = ids
        chunk["stop"] = False
        if counts:
            chunk["tokens_predicted"] = predicted[j]
            chunk["tokens_evaluated"] = len(group.gens[j].stream.prompt_tokens)
        if req.n_probs:
            chunk["completion_probabilities"] = convert.token_logprobs(logprobs, ids=True)
        return chunk

    async for j, fragment in group.merged():
        if fragment is None:
            done = await group.gens[j].result()
            if not fed[j] and done.logprobs and (counts or req.n_probs):
                yield chunk_of(j, "", done.logprobs)
            body = last(base + j, done)
            yield body if isinstance(body, dict) else await body
            continue
        if not (fragment.text or fragment.logprobs):
            continue
        fed[j] = fed[j] or bool(fragment.logprobs)
        yield chunk_of(j, fragment.text, fragment.logprobs)


def _infill_body(
    model_id: str,
    done: Completion,
    req: LlamaFields,
    max_tokens: int,
    *,
    streamed: bool = False,
    index: int = 0,
    extra: dict[str, object] | None = None,
) -> dict[str, object]:
    """llama-server's final ``/infill`` body (its ``/completion``'s, with ``extra``: its
    ``generation_settings`` and ``prompt``): a streamed reply's text and tokens went out in
    its chunks, so its last has none, as llama-server's."""
    s = done.stats
    # Found by review: a reply a stop string ended said "eos" and named no word; llama-server
    # says "word" and names it (a FIM client tells a stop string from the model's end by it).
    if s.finish_reason == "length":
        stop_type = "limit"
    elif s.stop_sequence is not None:
        stop_type = "word"
    else:
        stop_type = "eos"
    body: dict[str, object] = {
        "index": index,
        "content": "" if streamed else done.text,
        "tokens": list(done.completion_tokens) if req.return_tokens and not streamed else [],
        "stop": True,
        "model": model_id,
        "tokens_predicted": s.completion_tokens,
        "tokens_evaluated": s.prompt_tokens,
        "has_new_line": "\n" in done.text,
        # The context ran out before n_predict (the engine ends a reply there: no shift);
        # a line stop (n_indent, t_max_predict_ms) is a "limit" that truncated nothing.
        "truncated": (
            s.finish_reason == "length"
            and s.stopped_by is None
            and s.completion_tokens < max_tokens
        ),
        "stop_type": stop_type,
        "stopping_word": s.stop_sequence or "",
        "tokens_cached": s.cached_tokens,
        "timings": convert.timings(s),
        **(extra or {}),
    }
    if req.n_probs and not streamed:
        body["completion_probabilities"] = convert.token_logprobs(done.logprobs or (), ids=True)
    if req.response_fields is not None:
        return _fields(body, req.response_fields)
    return body


def _fields(body: dict[str, object], paths: Sequence[str]) -> dict[str, object]:
    """llama-server's ``response_fields``: only these fields, a path ``a/b`` naming ``b`` of
    object ``a`` under the key ``"a/b"``; a path that names nothing is left out."""
    out: dict[str, object] = {}
    for path in paths:
        value: object = body
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


# --- /completion (llama-server) --------------------------------------------------------------

#: llama-server's fields kvwarm has no sampler or control for, each with the value that turns
#: it off (its default): any other value is a 400 naming the field, never dropped silently.
_OFF: dict[str, tuple[object, str]] = {
    "id_slot": (-1, "kvwarm picks the slot (the one holding the longest cached prefix)"),
    "cache_prompt": (True, "kvwarm always reuses cached prompt KV, token-exact"),
    "mirostat": (0, "kvwarm has no mirostat sampler"),
    "dry_multiplier": (0.0, "kvwarm has no DRY sampler"),
    "xtc_probability": (0.0, "kvwarm has no XTC sampler"),
    "top_n_sigma": (-1.0, "kvwarm has no top-n-sigma sampler"),
    "dynatemp_range": (0.0, "kvwarm has no dynamic temperature"),
    "repeat_last_n": (64, "kvwarm's penalties count the reply's last 64 tokens"),
    "min_keep": (0, "kvwarm's truncations keep no minimum"),
    "samplers": (None, "kvwarm's samplers run in llama-server's default order, fixed"),
    "timings_per_token": (False, "kvwarm's timings come with the last chunk only"),
    "return_progress": (False, "kvwarm sends no prompt progress events"),
    "post_sampling_probs": (False, "kvwarm's probabilities are the model's, before sampling"),
}


#: Fields of ``_OFF`` that llama.cpp acts on only above 0 (``top_n_sigma``'s sampler, the
#: dynamic temperature's): 0 and any negative value are off. Found by review: only a negative
#: value was, so 0, their usual "off", was a 400.
_OFF_AT_OR_BELOW_ZERO = frozenset({"top_n_sigma", "dynatemp_range"})


#: llama-server's sampler letters (``common_sampler_type_to_chr``) and names
#: (``common_sampler_types_from_names``, with its aliases): its default order is
#: ``edskypmxt``. DRY (d), top-n-sigma (s) and XTC (x) are off in kvwarm, so where they
#: stand changes nothing; the others must keep the default order kvwarm's chain runs.
_SAMPLER_NAMES = {
    "penalties": "e", "dry": "d", "top_n_sigma": "s", "top_k": "k", "top-k": "k",
    "typ_p": "y", "typical_p": "y", "typical": "y", "top_p": "p", "top-p": "p",
    "nucleus": "p", "min_p": "m", "min-p": "m", "xtc": "x", "temperature": "t", "temp": "t",
}  # fmt: skip
_SAMPLERS_OFF_HERE = frozenset("dsx")


def _samplers_as_run(samplers: str | list[str] | None) -> bool:
    """Whether a ``samplers`` value asks for what kvwarm runs anyway: none, or llama-server's
    default order (its samplers kvwarm has off anywhere or left out). Found by review: the
    default order itself, which llama.cpp's web page and scripts send, was a 400."""
    if samplers is None:
        return True
    letters = (
        samplers if isinstance(samplers, str) else [_SAMPLER_NAMES.get(n, "?") for n in samplers]
    )
    active = "".join(c for c in letters if c not in _SAMPLERS_OFF_HERE)
    return active == "ekypmt"


def _as_run(req: LlamaFields, name: str, value: object) -> bool:
    """Whether ``value`` of ``_OFF``'s field ``name`` changes nothing kvwarm runs: values
    other than the one "off" value that are off too. Found by review: a client sending
    ``repeat_last_n`` with no penalty on, or ``min_keep`` 1, was refused."""
    if name in _OFF_AT_OR_BELOW_ZERO and isinstance(value, int | float):
        return value <= 0
    if name == "samplers":
        return _samplers_as_run(req.samplers)
    if name == "repeat_last_n":  # the window of penalties that are off counts nothing
        return value == 64 or (
            req.repeat_penalty in (None, 1.0)
            and not req.presence_penalty
            and not req.frequency_penalty
        )
    if name == "min_keep":  # llama.cpp's truncations keep one candidate at least anyway
        return value in (0, 1)
    return value == _OFF[name][0]


#: ``_OFF``'s fields /infill takes at any value and ignores, as docs/server.md says: llama.vim
#: sends ``samplers`` ["top_k", "top_p", "infill"] (a sampler kvwarm lacks) with every
#: request, which a 400 would turn away; ``cache_prompt`` and ``id_slot`` change no reply.
_INFILL_IGNORES = frozenset({"id_slot", "cache_prompt", "samplers"})


def refuse_unsupported(req: LlamaFields, ignored: frozenset[str] = frozenset()) -> None:
    """A 400 naming the first field of ``_OFF`` (but ``ignored``) given a value that would
    change what runs."""
    for name, (off, why) in _OFF.items():
        if name in ignored:
            continue
        value = getattr(req, name)
        if _as_run(req, name, value):
            continue
        raise HTTPError(
            400,
            f"{name} {value!r} is not supported: {why} (send {off!r}, or leave it out)",
            param=name,
            code="unsupported_parameter",
        )


def generation_settings(opts: GenerationOptions, n_probs: int, stream: bool) -> dict[str, object]:
    """llama-server's ``generation_settings``: the request's sampling as it ran, under
    llama-server's names (its samplers kvwarm lacks at their "off" values)."""
    bias = opts.logit_bias or {}
    return {
        # llama.cpp's LLAMA_DEFAULT_SEED: a fresh seed drawn per request.
        "seed": 0xFFFFFFFF if opts.seed is None else opts.seed,
        "temperature": opts.temperature,
        "top_k": opts.top_k,
        "top_p": opts.top_p,
        "min_p": opts.min_p,
        "typical_p": opts.typical_p,
        "repeat_last_n": 64,
        "repeat_penalty": opts.repeat_penalty,
        "presence_penalty": opts.presence_penalty,
        "frequency_penalty": opts.frequency_penalty,
        "mirostat": 0,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "top_n_sigma": -1.0,
        "dynatemp_range": 0.0,
        "stop": list(opts.stop),
        "max_tokens": opts.max_tokens,
        "n_predict": opts.max_tokens,
        "ignore_eos": opts.ignore_eos,
        "stream": stream,
        "logit_bias": [{"bias": b, "token": t} for t, b in bias.items()],
        "n_probs": n_probs,
        "min_keep": 0,
        "grammar": opts.grammar or "",
    }


_LLAMA_BODY = json_body(LlamaCompletionRequest, streams=True) | tenancy.openapi_header()


@router.post("/completion", openapi_extra=_LLAMA_BODY)
@router.post("/completions", openapi_extra=_LLAMA_BODY)
async def llama_completion(request: Request) -> Response:
    """llama-server's ``/completion``: each prompt continued, ``n`` (``n_cmpl``) choices of
    each, answered in its shape: one body, or a list of them (choice ``j`` of prompt ``i`` has
    index ``i * n + j``); streamed as ``data:`` chunks without ``[DONE]``."""
    state = server_state(request)
    req = await _read_prompts(request, state, LlamaCompletionRequest)
    refuse_unsupported(req)
    prompts = _prompts(req.prompt)
    limit, over_limit = state.settings.max_tokens_limit, state.settings.max_tokens_over_limit
    convert.length_within(req.n_predict, "n_predict", limit, over_limit)
    model, lora = await state.acquire_generation(
        req.model, keep_alive=req.keep_alive, lora=lora_pairs(req.lora)
    )
    opts = _llama_options(
        request,
        state,
        req,
        lora,
        json_schema=req.json_schema,
        # A stream's chunks carry their tokens' ids, which come with their logprobs.
        logprobs=req.n_probs or (0 if req.stream else None),
    )
    model_id = state.lora.reply_name(req.model, model)
    settings = generation_settings(opts, req.n_probs, req.stream)

    prompt_texts: dict[int, str] = {}  # per prompt: its n choices share one detokenization

    async def last(index: int, done: Completion) -> dict[str, object]:
        text = prompt_texts.get(index // req.n)
        if text is None:
            pieces = await run_in_threadpool(model.token_pieces, list(done.prompt_tokens))
            text = prompt_texts[index // req.n] = b"".join(pieces).decode("utf-8", "replace")
        extra: dict[str, object] = {"generation_settings": settings, "prompt": text}
        return _infill_body(
            model_id, done, req, opts.max_tokens, streamed=req.stream, index=index, extra=extra
        )

    def start(prompt: Prompt) -> Awaitable[Choices]:
        submit = functools.partial(model.streams, prompt, opts, n=req.n, fragments=req.stream)
        return Choices.start(
            request, submit, "completion", model.id, state, user=req.user, names=req.sent_as()
        )

    if not req.stream:
        bodies: list[dict[str, object]] = []
        for p_index, prompt in enumerate(prompts):
            group = await start(prompt)
            async with group:
                results = await group.results()
            if group.disconnected:
                return Response(status_code=499)
            for j, done in enumerate(results):
                bodies.append(await last(p_index * req.n + j, done))
        return JSONResponse(bodies[0] if len(bodies) == 1 else bodies)

    current = [await start(prompts[0])]  # the group streaming now, closed however it ends
    await current[0].open_streaming()

    async def events() -> AsyncIterator[dict[str, object]]:
        for p_index, prompt in enumerate(prompts):
            if p_index:
                current[0].close()
                current[0] = await start(prompt)
                await current[0].open_streaming()
            base = p_index * req.n
            chunks = _llama_chunks(current[0], req, last, base=base, counts=True)
            async for chunk in chunks:
                yield chunk
            if current[0].disconnected:
                return

    def close() -> None:
        current[0].close()  # the group streaming when the response ends (the earlier: closed)

    return StreamingResponse(
        sse(events(), close, done_line=False),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )
