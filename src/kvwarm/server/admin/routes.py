"""Operational endpoints: health, metrics, tokenize/detokenize, llama-server's ``/props`` and
``/slots``, and cache administration.

Invariant: ``/health`` is 200 once the configured models have been loaded and at least one model
can be served (``status`` "degraded" while some failed); while they load it is a 503 with an
OpenAI-shaped error (``code`` model_loading), and a 503 with ``model_load_failed`` when nothing
can be served. Cache administration acts on the one shared ``Cache`` of the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvwarm._version import __version__
from kvwarm.backends.chat_template import BUILTIN_TEMPLATES
from kvwarm.cache.sizes import row_sizes, summary
from kvwarm.cache.types import RowInfo, TtlClass
from kvwarm.engine.types import CompletionStats, ModelStatus
from kvwarm.errors import ContextOverflowError, InvalidRequestError
from kvwarm.server import convert, tenancy
from kvwarm.server.budget import cache_shares
from kvwarm.server.errors import HTTPError, error_body, rename_param
from kvwarm.server.keepalive import ChatPrefix, prompt_tokens
from kvwarm.server.media import fetch_images
from kvwarm.server.openai.completions import generation_settings
from kvwarm.server.schemas import (
    DetokenizeRequest,
    EvictRequest,
    PrewarmRequest,
    SamplingFields,
    TokenizeRequest,
    check_count,
    json_body,
    parse_body,
    read_json,
)
from kvwarm.server.served import stalled_for
from kvwarm.server.state import server_state
from kvwarm.server.tools import openai_tools, template_messages

router = APIRouter()


# Two routes, not one of two methods: FastAPI names both methods' operations alike, and the
# schema then held one operation id twice (a warning on every schema build).
@router.get("/health")
@router.head("/health", include_in_schema=False)
async def health(request: Request) -> Response:
    """200 once startup loading is over and some model can be served ("degraded" if some
    failed: requests naming those get a 503 with the reason); 503 before, or if none can.
    ``HEAD`` too: the health check of many load balancers."""
    state = server_state(request)
    # A model whose worker thread died refuses every request (found by review: /health said
    # ok meanwhile): it is failed from here on; with no other model left, the server is down.
    state.registry.notice_deaths()
    entries = list(state.entries.values())  # a snapshot: a rescan may add entries meanwhile
    models = {e.id: e.state for e in entries}
    errors = {e.id: e.error for e in entries if e.state == "failed"}
    failure = state.registry.startup_failure() if state.startup_done else None
    dead = {e.id for e in entries if e.state == "failed" and e.died}
    if failure is None and entries and all(e.id in errors for e in entries):
        failure = "; ".join(f"{i}: {r}" for i, r in errors.items())
    if state.startup_done and failure is None:
        stalled = _stalled(entries, state.settings.worker_stall_s)
        degraded = bool(errors or stalled)
        body: dict[str, object] = {"status": "degraded" if degraded else "ok", "models": models}
        if errors:
            body["errors"] = errors
        if stalled:
            body["stalled"] = stalled
        return JSONResponse(body)
    if failure is not None:
        code = "worker_died" if dead and len(errors) == len(dead) else "model_load_failed"
        message, status = failure, "error"
    else:
        message = "loading: " + ", ".join(i for i, s in models.items() if s == "loading")
        code, status = "model_loading", "loading"
    body = {**error_body(message, "service_unavailable", code), "status": status, "models": models}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


def _stalled(entries: list[Any], limit_s: float) -> dict[str, float]:
    """Models whose worker has not ticked for more than ``limit_s`` seconds (issue 23)."""
    if limit_s <= 0:
        return {}
    out: dict[str, float] = {}
    for entry in entries:
        model = entry.model
        if entry.state == "ready" and model is not None:
            age = stalled_for(model)
            if age > limit_s:
                out[entry.id] = round(age, 1)
    return out


# The Prometheus text format, or OpenMetrics when the scraper asks for it; never JSON.
_METRICS_CONTENT = {
    "text/plain": {"schema": {"type": "string"}},
    "application/openmetrics-text": {"schema": {"type": "string"}},
}


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": _METRICS_CONTENT, "description": "the metrics"}},
)
async def prometheus(request: Request) -> Response:
    body, content_type = server_state(request).counters.exposition(request.headers.get("accept"))
    return Response(body, media_type=content_type)


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), TokenizeRequest)
    model = await state.acquire(req.model)

    def bounded() -> list[int]:
        # Found by review: unbounded, an 8 MB body answered millions of tokens (~260 MB of
        # RSS, more with pieces). Bounded as a prompt is, by the model's context: no request
        # can use more tokens than that, and the refusal still says how many there were.
        tokens = model.tokenize(
            req.content, add_special=req.add_special, parse_special=req.parse_special
        )
        n_ctx = model.info().n_ctx
        if len(tokens) > n_ctx:
            raise ContextOverflowError(
                f"content has {len(tokens)} tokens; /tokenize answers at most this model's "
                f"context, {n_ctx} tokens",
                n_tokens=len(tokens),
                n_ctx=n_ctx,
                param="content",
            )
        return tokens

    tokens = await run_in_threadpool(bounded)
    if not req.with_pieces:
        return JSONResponse({"tokens": tokens})
    # Found by review: each piece was the token detokenized alone, so a special token's was
    # "" and a byte of a character split over tokens was U+FFFD, and it cost one call (a
    # replica round trip in a cluster) per token. As llama-server: the token's bytes, as
    # text where they are UTF-8, else as the list of their values.
    pieces = await run_in_threadpool(model.token_pieces, tokens)
    return JSONResponse(
        {"tokens": [{"id": t, "piece": _piece(p)} for t, p in zip(tokens, pieces, strict=True)]}
    )


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), DetokenizeRequest)
    model = await state.acquire(req.model)
    return JSONResponse({"content": await run_in_threadpool(model.detokenize, req.tokens)})


# --- cache administration --------------------------------------------------------------------


def _row(row: RowInfo) -> dict[str, object]:
    return {
        "key": row.key.hex(),
        "tier": row.tier,
        **row_sizes(row),
        "n_tokens": row.n_tokens,
        "hits": row.hits,
        "last_used": row.last_used,
        "created": row.created,
        "reason": row.reason.name.lower(),
        "ttl_class": row.ttl_class.name.lower(),
        "has_logits": row.has_logits,
        "fingerprint": row.namespace.fingerprint.hex(),
    }


_EFFECTIVE = "_effective_quota_bytes"


def _tier_quotas(counters: Mapping[str, float]) -> dict[str, dict[str, object]]:
    """Per configured tier: its quota, its effective quota (capped by the room on its
    filesystem, ``cache/store/quota.py``) and whether that cap applies now."""
    quotas: dict[str, dict[str, object]] = {}
    for name, effective in counters.items():
        if name.startswith("tier_") and name.endswith(_EFFECTIVE):
            tier = name[len("tier_") : -len(_EFFECTIVE)]
            quotas[tier] = {
                "quota_bytes": int(counters.get(f"tier_{tier}_quota_bytes", effective)),
                "effective_quota_bytes": int(effective),
                "quota_capped_by_filesystem": bool(
                    counters.get(f"tier_{tier}_quota_capped_by_filesystem", 0.0)
                ),
            }
    return quotas


@router.get("/cluster")
async def cluster(request: Request) -> Response:
    """``kvwarm cluster`` only (404 elsewhere): each engine replica (id, node, process,
    health, load) and what its cache holds, as it reports and as the router's index of its
    cache events has it; the index's sizes (docs/cluster.md, "GET /cluster")."""
    return JSONResponse(server_state(request).cluster_view())


@router.get("/cache/stats")
async def cache_stats(request: Request) -> Response:
    """Rows and bytes per tier (``cache.sizes.summary``: physical ``bytes``, each chunk once,
    ``logical_bytes``, ``dedup_ratio``, the effective quota, restores), the counters they come
    from, the keep-alive entries, what the models and tiers take of memory (``memory``) and
    each model's running totals over the server's lifetime (``model_totals``: its unloads
    included, ``server/totals.py``)."""
    state = server_state(request)
    cache = state.require_engine().cache
    counters = await run_in_threadpool(cache.counters)
    rows = await run_in_threadpool(cache.rows)
    stored = {t: int(counters.get(f"tier_{t}_bytes", 0)) for t in cache.tier_names()}
    shares = cache_shares(rows, stored, state.cache_owners())
    return JSONResponse(
        {
            "counters": dict(counters),
            **summary(counters, rows, cache.tier_names()),
            "memory": state.memory.report(stored, shares),
            "quotas": _tier_quotas(counters),
            "model_totals": {
                model_id: {k: round(v, 3) if k.endswith("_ms") else int(v) for k, v in t.items()}
                for model_id, t in state.model_totals().items()
            },
            "keep_alive": [
                {
                    "model": e.model_id,
                    "ttl_class": e.ttl_class.name.lower(),
                    "warms": e.warms,
                    "failures": e.failures,
                }
                for e in state.keepalive.entries()
            ],
        }
    )


@router.get("/cache/slots")
async def cache_slots(request: Request) -> Response:
    """Each ready model's counters and its slots: what each holds, as its worker last
    published it (``Model.status``; no call reaches the worker thread). A cluster's
    ingress has no slots: 501, each replica answers for its own."""
    state = server_state(request)
    if state.is_cluster:
        state.require_engine()  # 501 there: not an empty list, which would say "no slots"
    statuses = state.metrics_snapshot().statuses
    return JSONResponse({"object": "list", "data": [_model_status(s) for s in statuses]})


def _model_status(status: ModelStatus) -> dict[str, object]:
    body = asdict(status)
    body["prefill_ms"] = round(status.prefill_ms, 3)
    body["generation_ms"] = round(status.generation_ms, 3)
    body["prewarm_ms"] = round(status.prewarm_ms, 3)
    for slot in body["slots"]:
        slot["last_used"] = round(slot["last_used"], 3)
    return body


@router.get("/cache/rows")
async def cache_rows(
    request: Request,
    # Validated by pydantic (ASCII digits, bounded): str.isdigit() accepts "²", which int()
    # then refuses, and a 5,000-digit number passes int()'s limit. Either is a 400, not a 500.
    # 1 or more, as `kvwarm cache ls --limit`: 0 meant "none" here and "all" there.
    limit: Annotated[
        int | None,
        Query(ge=1, le=1 << 31, description="most rows to list, 1 or more (default: all)"),
    ] = None,
) -> Response:
    state = server_state(request)
    cache = state.require_engine().cache
    rows = await run_in_threadpool(cache.rows)
    rows.sort(key=lambda r: r.last_used, reverse=True)
    if limit is not None:
        rows = rows[:limit]
    return JSONResponse({"object": "list", "data": [_row(r) for r in rows]})


@router.get("/cache/rows/{key}")
async def cache_row(
    request: Request,
    key: str,
    wait_ms: Annotated[
        int, Query(ge=0, le=60_000, description="wait this long for an in-flight save")
    ] = 0,
) -> Response:
    """One row by its hex key (a response's ``timings.cache_key``). A ``cache_key`` may name a
    save still being written; ``wait_ms`` waits for it to publish. 404 if it is not there."""
    state = server_state(request)
    cache = state.require_engine().cache
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raise HTTPError(400, "key must be hex", code="invalid_value", param="key") from None
    if not raw or len(raw) > 64:
        raise HTTPError(400, "key must be 1 to 64 bytes of hex", code="invalid_value", param="key")
    row = await run_in_threadpool(cache.lookup_exact_or_wait, raw, wait_ms / 1e3)
    if row is None:
        raise HTTPError(404, f"no published row {key}", param="key", code="row_not_found")
    # The row with its sizes as of now (rows() computes them; a lookup does not).
    sized = [r for r in await run_in_threadpool(cache.rows, row.namespace) if r.key == raw]
    return JSONResponse(_row(sized[0] if sized else row))


@router.post("/cache/prewarm", openapi_extra=json_body(PrewarmRequest) | tenancy.openapi_header())
async def cache_prewarm(request: Request) -> Response:
    """Prefill a prefix (e.g. a system prompt) and save it, generating nothing. The row (and
    its keep-alive) belongs to the request's cache salt, or to the tenant the body names
    (``tenant_key``, ``shared``: ``server.tenancy``)."""
    state = server_state(request)
    raw = await read_json(request, state.settings)
    # A chat as every chat route bounds it (found by review: a prewarm's was held to none).
    check_count(raw, "messages", state.settings.max_chat_messages, "max_chat_messages")
    req = parse_body(raw, PrewarmRequest)
    base = None if req.model is None else state.lora.base_of(req.model)
    if base is not None:
        # Found by review: an adapter's name resolved to its model and the prefix was
        # prewarmed (and kept alive) in the model's own rows, which requests naming the
        # adapter never use (each adapter set is a namespace of its own): a 200 that did
        # nothing for them.
        raise HTTPError(
            400,
            f"{req.model!r} is a LoRA adapter: prewarm fills the rows of its model, {base!r}, "
            "without adapters, which requests for the adapter do not use",
            param="model",
            code="invalid_value",
        )
    # The body's own faults before its model is acquired (found by review: the model was
    # loaded, and stayed, for a body then refused).
    if (req.prompt is None) == (req.messages is None):
        raise HTTPError(
            400, "give exactly one of prompt or messages", code="invalid_value", param="prompt"
        )
    ttl = TtlClass[req.ttl_class.upper()]
    salt = tenancy.prewarm_salt(
        request, req.cache_salt, state.settings, tenant_key=req.tenant_key, shared=req.shared
    )
    model = await state.acquire(req.model)
    # What keep-alive would hold: the prompt, or a chat as its messages (images given by an
    # http(s) URL fetched first, if their host is allowed, as a chat's are), whose images and
    # audio its ids alone could not prefill again.
    prompt: str | tuple[int, ...] | ChatPrefix
    tools = openai_tools(req.tools) if req.tools else None
    if req.messages is not None:
        messages = await fetch_images(req.messages, state.settings)
        prompt = ChatPrefix.of(template_messages(messages, native=tools is not None), tools)
    else:
        assert req.prompt is not None
        # Ids as a tuple: keep-alive keys its entries by the prompt, which must be hashable.
        prompt = req.prompt if isinstance(req.prompt, str) else tuple(req.prompt)

    def work() -> CompletionStats:
        if isinstance(prompt, ChatPrefix):
            # The prompt Model.stream_chat builds for a chat that starts with these messages,
            # their images and audio included (each span cached by its content), as
            # keep-alive will re-warm it.
            return prompt.prewarm(model, ttl, salt)
        return model.prewarm(prompt, ttl_class=ttl, add_special=True, cache_salt=salt)

    try:
        if req.keep_alive:  # refuse before the prefill, not after it
            known = await run_in_threadpool(prompt_tokens, model, prompt)
            state.keepalive.check_room(model.id, prompt, known, cache_salt=salt)
        stats = await run_in_threadpool(work)
    except InvalidRequestError as exc:
        if isinstance(prompt, ChatPrefix):
            # The prompt is the messages: a fault of it names them (found by review: a chat
            # too short for a row named ``prompt``, a field the body did not have).
            rename_param(exc, {"prompt": "messages"})
        raise
    if req.keep_alive:
        state.keepalive.register(
            model.id,
            prompt,
            ttl,
            n_tokens=stats.prompt_tokens,
            cache_salt=salt,
        )
    return JSONResponse(
        {
            "model": model.id,
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "prefill_ms": round(stats.prefill_ms, 3),
            "key": stats.key.hex() if stats.key else None,
            "ttl_class": req.ttl_class,
            "keep_alive": req.keep_alive,
        }
    )


@router.get("/cache/keepalive")
async def keepalive_list(request: Request) -> Response:
    """The prefixes kept warm, with the limits that bound them."""
    keep = server_state(request).keepalive
    now, limits = keep.now(), keep.limits
    data = [
        {
            "id": e.id,
            "model": e.model_id,
            "ttl_class": e.ttl_class.name.lower(),
            "n_tokens": e.n_tokens,
            "warms": e.warms,
            "failures": e.failures,
            "failing": e.failing,  # failures in a row: the backoff's exponent
            # While it backs off: seconds before its next re-warm is tried.
            "retry_in_s": round(max(0.0, e.retry_at - now), 3) if e.failing else None,
            "pinned": e.pinned,
            "salted": e.cache_salt is not None,  # the salt itself is a tenant's secret
            "age_s": round(now - e.registered, 3),
            "expires_in_s": None
            if e.pinned or limits.max_age_s <= 0
            else round(max(0.0, e.registered + limits.max_age_s - now), 3),
        }
        for e in keep.entries()
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "limits": {
                "max_entries": limits.max_entries,
                "max_tokens": limits.max_tokens,
                "max_age_s": limits.max_age_s,
            },
        }
    )


@router.delete("/cache/keepalive")
async def keepalive_clear(request: Request) -> Response:
    return JSONResponse({"deleted": server_state(request).keepalive.remove()})


@router.delete("/cache/keepalive/{entry_id}")
async def keepalive_delete(request: Request, entry_id: str) -> Response:
    if not server_state(request).keepalive.remove(entry_id):
        raise HTTPError(
            404, f"no keep-alive entry {entry_id!r}", code="not_found", param="entry_id"
        )
    return JSONResponse({"deleted": 1})


@router.post("/cache/evict", openapi_extra=json_body(EvictRequest))
async def cache_evict(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), EvictRequest)
    cache = state.require_engine().cache
    result = await run_in_threadpool(lambda: cache.evict_bytes(req.bytes, req.tiers))
    return JSONResponse({"rows": result.rows, "bytes": result.bytes})


@router.post("/cache/gc")
async def cache_gc(request: Request) -> Response:
    cache = server_state(request).require_engine().cache
    result = await run_in_threadpool(cache.gc)
    return JSONResponse({"rows": result.rows, "bytes": result.bytes})


@router.post("/cache/verify")
async def cache_verify(request: Request) -> Response:
    cache = server_state(request).require_engine().cache
    report = await run_in_threadpool(cache.verify)
    bad = [{"row": where, "reason": why} for where, why in report.bad]
    return JSONResponse({"checked": report.checked, "bad": bad})


# --- llama-server's /props and /slots --------------------------------------------------------


def _model_query() -> Any:
    return Query(description="the model (default: the first configured one)")


@router.get("/props")
async def props(request: Request, model: Annotated[str | None, _model_query()] = None) -> Response:
    """llama-server's ``GET /props``: the model's context, slots, template, special tokens and
    the sampling a request gets by default, under llama-server's names."""
    state = server_state(request)
    # A GET loads no model (nor unloads an idle one to make room): any web page may send it,
    # with no Origin header (``guard.py``). Found by review: both did.
    served = await state.acquire(model, load=False)
    info = await run_in_threadpool(served.info)
    meta = info.metadata
    special: dict[str, str] = {}
    for name in ("bos", "eos"):
        token = meta.get(f"tokenizer.ggml.{name}_token_id", "")
        pieces = (
            await run_in_threadpool(served.token_pieces, [int(token)]) if token.isdigit() else []
        )
        special[name] = b"".join(pieces).decode("utf-8", "replace")
    defaults = convert.options(
        SamplingFields(),
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_limit=state.settings.max_tokens_limit,
        over_limit=state.settings.max_tokens_over_limit,
    )
    return JSONResponse(
        {
            "default_generation_settings": {
                "params": generation_settings(defaults, 0, False),
                "n_ctx": info.n_ctx,
            },
            "total_slots": info.n_parallel,
            "model_alias": state.lora.reply_name(model, served),
            "model_path": info.path,
            "modalities": {
                "vision": "image" in info.media,
                "video": False,
                "audio": "audio" in info.media,
            },
            "chat_template": _template_source(info.chat_template_name, meta),
            "bos_token": special["bos"],
            "eos_token": special["eos"],
            "build_info": f"kvwarm {__version__}",
            "endpoint_slots": True,
            "endpoint_props": False,  # POST /props changes nothing (props_update)
            "endpoint_metrics": True,
            "is_sleeping": False,
        }
    )


def _template_source(name: str, meta: Mapping[str, str]) -> str:
    """The chat template's Jinja source ("" where kvwarm cannot say it: a template file)."""
    if name == "gguf":
        return meta.get("tokenizer.chat_template", "")
    return BUILTIN_TEMPLATES.get(name.removesuffix(" (fallback)"), "")


@router.post("/props")
async def props_update(request: Request) -> Response:
    """llama-server's ``POST /props`` (admin): no global property can be changed over HTTP
    (llama-server's own changes none either), so any field is a 400 naming it; an empty
    object answers as llama-server does."""
    state = server_state(request)
    body = await read_json(request, state.settings)
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object", code="invalid_json")
    for name in body:
        raise HTTPError(
            400,
            f"{name} cannot be changed over HTTP: kvwarm's settings are its configuration "
            "(flags, config file); a request's own fields change its sampling",
            param=str(name),
            code="unsupported_parameter",
        )
    return JSONResponse({"success": True})


@router.get("/slots")
async def slots(
    request: Request,
    model: Annotated[str | None, _model_query()] = None,
    fail_on_no_slot: Annotated[
        str | None, Query(description="any value: a 503 when no slot is idle")
    ] = None,
) -> Response:
    """llama-server's ``GET /slots``: each slot of the model, its counts only. Never a
    request's prompt, reply or sampling settings (llama-server's ``prompt``, ``generated``,
    ``params``): a slot may hold another tenant's request (``server/tenancy.py``). A
    cluster's ingress has no slots: 501, as ``/cache/slots`` (each replica answers for its
    own). Found by review: it answered an empty list, and with ``fail_on_no_slot`` a 503 on
    every call."""
    state = server_state(request)
    if state.is_cluster:
        state.require_engine()  # 501 there: not an empty list, which would say "no slots"
    # A GET loads no model (nor unloads an idle one to make room): any web page may send it,
    # with no Origin header (``guard.py``). Found by review: both did.
    served = await state.acquire(model, load=False)
    status = served.status()
    n_ctx = (await run_in_threadpool(served.info)).n_ctx
    data = [
        {
            "id": slot.seq,
            "n_ctx": n_ctx,
            "is_processing": slot.phase != "idle",
            "n_prompt_tokens": slot.prompt_tokens,
            "n_prompt_tokens_cache": slot.cached_tokens,
            "n_prompt_tokens_processed": max(slot.prompt_tokens - slot.cached_tokens, 0),
            "next_token": [{"n_decoded": slot.generated}],
        }
        for slot in status.slots
    ]
    if fail_on_no_slot is not None and all(s["is_processing"] for s in data):
        raise HTTPError(503, "no slot available", code="no_slot_available")
    return JSONResponse(data)
