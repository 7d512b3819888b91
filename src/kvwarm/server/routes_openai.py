"""The OpenAI-compatible endpoints: embeddings and models here; chat completions in
``routes_chat``, completions and ``/infill`` in ``routes_completions``.

Invariant: handlers never block the event loop on the engine: blocking calls (template
rendering, tokenizing, embedding) run in the thread pool and generation is awaited through the
engine's async stream. Each generation runs inside ``Choices`` so a disconnect cancels it.
"""

from __future__ import annotations

import base64
import struct

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvwarm.server.errors import HTTPError
from kvwarm.server.generate import request_log
from kvwarm.server.schemas import EmbeddingRequest, json_body, parse_body, read_json
from kvwarm.server.state import ServerState

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def server_state(request: Request) -> ServerState:
    state = request.app.state.kvwarm
    assert isinstance(state, ServerState)
    return state


# --- /v1/embeddings, /v1/models --------------------------------------------------------------


@router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
async def embeddings(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), EmbeddingRequest)
    model = state.model(req.model)
    raw = req.input
    # Token ids go to the model as they are: no detokenize / re-tokenize round trip.
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [[x for x in raw if isinstance(x, int)]]
    else:
        items = [x for x in raw if isinstance(x, str | list)]
    if not items:
        raise HTTPError(400, "input must not be empty", param="input")

    def work() -> tuple[list[list[float]], int]:
        vectors = model.embed(items)
        n_tokens = sum(len(model.tokenize(x)) if isinstance(x, str) else len(x) for x in items)
        return vectors, n_tokens

    vectors, n_tokens = await run_in_threadpool(work)
    data: list[dict[str, object]] = []
    for index, full in enumerate(vectors):
        cut = req.dimensions if req.dimensions and 0 < req.dimensions < len(full) else len(full)
        vector = full[:cut]
        encoded: list[float] | str = vector
        if req.encoding_format == "base64":
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    request_log.info(
        "embeddings model=%s inputs=%d prompt_tokens=%d", model.id, len(items), n_tokens
    )
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model.id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


def _model_item(state: ServerState, entry_id: str) -> dict[str, object]:
    entry = state.entries[entry_id]
    item: dict[str, object] = {
        "id": entry.id,
        "object": "model",
        "created": int(state.started),
        "owned_by": "kvwarm",
        "status": entry.state,
    }
    if entry.model is not None:
        info = entry.model.info()
        item["meta"] = {
            "path": info.path,
            "backend": info.backend,
            "n_ctx": info.n_ctx,
            "n_ctx_train": info.n_ctx_train,
            "n_vocab": info.n_vocab,
            "n_embd": info.n_embd,
            "n_parallel": info.n_parallel,
            "size": info.size_bytes,
            "description": info.description,
            "fingerprint": info.fingerprint,
            "chat_template": info.chat_template,
        }
    elif entry.error:
        item["error"] = entry.error
    return item


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = server_state(request)
    data = [_model_item(state, entry_id) for entry_id in state.entries]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> Response:
    """One model, as OpenAI's ``models.retrieve`` returns it; 404 ``model_not_found``."""
    state = server_state(request)
    if model_id not in state.entries:
        raise HTTPError(
            404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
        )
    return JSONResponse(_model_item(state, model_id))
