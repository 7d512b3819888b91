"""``/v1/rerank`` (and ``/rerank``, ``/v2/rerank``, llama-server's ``/reranking``): Jina's and
Cohere's rerank API, as llama-server serves it with ``--rerank``, on a model whose pooling is rank.

Invariant: the handler never blocks the event loop: the rerank (tokenizing, then waiting for
every document's score from the worker) runs in the thread pool, as ``/v1/embeddings`` does,
under ``request_timeout_s``; the client's disconnect cancels it (``run_cancellable``).
The documents go through the model's queue, slots and batching like any request
(``kvwarm.engine.rerank``); a model that is not a reranker answers 400 ``unsupported_by_model``.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvwarm.engine.cancel import Cancellation
from kvwarm.engine.types import Reranking
from kvwarm.server import tenancy
from kvwarm.server.errors import HTTPError
from kvwarm.server.generate import request_log, run_cancellable
from kvwarm.server.schemas import (
    RerankRequest,
    check_count,
    json_body,
    lora_pairs,
    parse_body,
    read_json,
)
from kvwarm.server.state import server_state
from kvwarm.settings import Settings

router = APIRouter()


def most_documents(settings: Settings) -> int:
    """The largest ``rerank_max_documents`` of any configured model (the global value, or a
    ``[[models]]`` table's)."""
    values = [settings.rerank_max_documents]
    for spec in settings.models:
        value = dict(spec.options).get("rerank_max_documents")
        if isinstance(value, int):
            values.append(value)
    return max(values)


@router.post("/v1/rerank", openapi_extra=json_body(RerankRequest) | tenancy.openapi_header())
@router.post("/rerank", openapi_extra=json_body(RerankRequest) | tenancy.openapi_header())
@router.post("/v2/rerank", openapi_extra=json_body(RerankRequest) | tenancy.openapi_header())
# llama-server's own name for it (its README's), and its /v1 twin: a client written for
# llama-server's /reranking got a 404 (found by review).
@router.post("/reranking", openapi_extra=json_body(RerankRequest) | tenancy.openapi_header())
@router.post("/v1/reranking", openapi_extra=json_body(RerankRequest) | tenancy.openapi_header())
async def rerank(request: Request) -> Response:
    """The documents by relevance to the query, best first."""
    state = server_state(request)
    body = await read_json(request, state.settings)
    # Counted before validation builds an object per document; each model checks its own
    # limit again (rerank_max_documents may be set per model: the largest bounds this one).
    check_count(body, "documents", most_documents(state.settings), "rerank_max_documents")
    req = parse_body(body, RerankRequest)
    if req.model is not None and state.lora.base_of(req.model) is not None:
        raise HTTPError(
            400,
            f"{req.model!r} is a LoRA adapter: adapters apply to generation; rerank with a "
            "reranker",
            param="model",
            code="unsupported_by_model",
        )
    # The model's global LoRA scales (POST /lora-adapters), as llama-server reranks under
    # them (its rerank tasks run under the server's adapters); found by review: they were
    # dropped here, so a reranker with an adapter on scored with the base model alone.
    model, lora = await state.acquire_generation(
        req.model, keep_alive=req.keep_alive, lora=lora_pairs(req.lora)
    )
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    salt = tenancy.cache_salt(request, req.cache_salt, state.settings)

    def work(cancel: Cancellation) -> Reranking:
        return model.rerank(
            req.query,
            texts,
            top_n=req.top_n,
            max_tokens_per_doc=req.max_tokens_per_doc,
            cache_salt=salt,
            lora=lora,
            # A generation's deadline (found by review: a rerank had none, so one of a
            # thousand long documents held the model's queue as long as it took, its client
            # long gone; under kvwarm cluster the replica went on after the ingress gave up).
            timeout_s=state.settings.request_timeout_s or None,
            cancel=cancel,  # the client's disconnect
        )

    ranking = await run_cancellable(request, state, work)
    results: list[dict[str, object]] = []
    for result in ranking.results:
        item: dict[str, object] = {
            "index": result.index,
            "relevance_score": result.relevance_score,
        }
        if req.return_documents:
            item["document"] = {"text": texts[result.index]}
        results.append(item)
    request_log.info(
        "rerank model=%s documents=%d prompt_tokens=%d cached_tokens=%d",
        model.id,
        len(texts),
        ranking.prompt_tokens,
        ranking.cached_tokens,
    )
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "object": "list",
            "model": model.id,
            "results": results,
            "usage": {
                "prompt_tokens": ranking.prompt_tokens,
                "total_tokens": ranking.prompt_tokens,
                "prompt_tokens_details": {"cached_tokens": ranking.cached_tokens},
            },
            # Cohere's clients read their units here.
            "meta": {"billed_units": {"search_units": 1}},
        }
    )
