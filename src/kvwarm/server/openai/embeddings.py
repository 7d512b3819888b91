"""``/v1/embeddings``: pooled vectors, as floats or base64; llama-server's ``/embedding``.

Invariant: handlers never block the event loop on the engine: blocking calls (template
rendering, tokenizing, embedding) run in the thread pool and generation is awaited through the
engine's async stream. An embedding runs under ``request_timeout_s`` (past it 503
``request_timeout``) and the client's disconnect cancels it (``run_cancellable``).
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvwarm.engine.cancel import Cancellation
from kvwarm.server.errors import HTTPError
from kvwarm.server.generate import request_log, run_cancellable
from kvwarm.server.schemas import (
    EmbeddingRequest,
    LlamaEmbeddingRequest,
    LoraItem,
    check_count,
    json_body,
    lora_pairs,
    parse_body,
    read_json,
)
from kvwarm.server.state import server_state

if TYPE_CHECKING:
    from kvwarm.server.served import ServedModel

router = APIRouter()

# --- /v1/embeddings --------------------------------------------------------------------------


@router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
async def embeddings(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request, state.settings)
    check_count(body, "input", state.settings.max_embedding_inputs, "max_embedding_inputs")
    req = parse_body(body, EmbeddingRequest)
    model, vectors, n_tokens = await _embedded(
        request, req.model, req.keep_alive, req.lora, req.input, "input"
    )
    data: list[dict[str, object]] = []
    for index, full in enumerate(vectors):
        vector = full if req.dimensions is None else _shortened(full, req.dimensions)
        encoded: list[float] | str = vector
        if req.encoding_format == "base64":
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model.id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


async def _embedded(
    request: Request,
    model_name: str | None,
    keep_alive: float | str | None,
    lora_items: list[LoraItem] | None,
    raw: str | Sequence[str | int | Sequence[int]],
    param: str,
    *,
    normalize: bool = True,
) -> tuple[ServedModel, list[list[float]], int]:
    """The model, one pooled vector per input of ``raw`` (the body's field ``param``: a text,
    token ids, or a list of them) and the inputs' token count: what ``/v1/embeddings`` and
    llama-server's ``/embedding`` share."""
    state = server_state(request)
    if model_name is not None and state.lora.base_of(model_name) is not None:
        raise HTTPError(
            400,
            f"{model_name!r} is a LoRA adapter: adapters apply to generation; embed with its "
            f"model, {state.lora.base_of(model_name)!r}",
            param="model",
            code="invalid_value",
        )
    # The model's global LoRA scales (POST /lora-adapters), as llama-server embeds under them;
    # found by review: they were dropped here, so embeddings ran the base model alone.
    model, lora = await state.acquire_generation(
        model_name, keep_alive=keep_alive, lora=lora_pairs(lora_items)
    )
    # Token ids go to the model as they are: no detokenize / re-tokenize round trip.
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [[x for x in raw if isinstance(x, int)]]
    else:
        items = [x if isinstance(x, str) else list(x) for x in raw if isinstance(x, str | list)]
    if not items:
        raise HTTPError(400, f"{param} must not be empty", code="invalid_value", param=param)

    def work(cancel: Cancellation) -> tuple[list[list[float]], int]:
        # Under a generation's deadline, and cancelled by the client's disconnect (found by
        # review: one request of many long inputs held the model's queue as long as it took,
        # its client long gone).
        vectors = model.embed(
            items,
            normalize=normalize,
            lora=lora,
            timeout_s=state.settings.request_timeout_s or None,
            cancel=cancel,
        )
        # The embedding context is created (or grown) on use: count it against the budget.
        state.remeasure(model.id, model)
        n_tokens = sum(len(model.tokenize(x)) if isinstance(x, str) else len(x) for x in items)
        return vectors, n_tokens

    vectors, n_tokens = await run_cancellable(request, state, work)
    request_log.info(
        "embeddings model=%s inputs=%d prompt_tokens=%d", model.id, len(items), n_tokens
    )
    return model, vectors, n_tokens


# --- /embedding, /embeddings (llama-server) --------------------------------------------------


@router.post("/embedding", openapi_extra=json_body(LlamaEmbeddingRequest))
@router.post("/embeddings", openapi_extra=json_body(LlamaEmbeddingRequest))
async def llama_embedding(request: Request) -> Response:
    """llama-server's own embeddings: a list of ``{"index", "embedding"}``, each embedding a
    list of vectors (kvwarm pools every input: one vector, as llama-server's with pooling)."""
    state = server_state(request)
    body = await read_json(request, state.settings)
    field = "input" if isinstance(body, dict) and "input" in body else "content"
    check_count(body, field, state.settings.max_embedding_inputs, "max_embedding_inputs")
    req = parse_body(body, LlamaEmbeddingRequest)
    raw = req.input if req.input is not None else req.content
    if raw is None:
        raise HTTPError(
            400, "give content (or input): the text to embed", code="invalid_type", param="content"
        )
    if req.embd_normalize not in (-1, 2):
        raise HTTPError(
            400,
            f"embd_normalize {req.embd_normalize} is not supported: kvwarm's vectors are of unit "
            "length (2, the default) or as pooled (-1)",
            param="embd_normalize",
            code="unsupported_parameter",
        )
    _, vectors, _ = await _embedded(
        request, req.model, req.keep_alive, req.lora, raw, field, normalize=req.embd_normalize == 2
    )
    return JSONResponse([{"index": i, "embedding": [v]} for i, v in enumerate(vectors)])


def _shortened(full: list[float], dimensions: int) -> list[float]:
    """OpenAI's ``dimensions``: the first values of the (unit) vector, scaled back to unit
    length as OpenAI's shortened embeddings are (a zero vector stays zero); more dimensions
    than the model has is a 400, not the full vector under another size."""
    if dimensions > len(full):
        raise HTTPError(
            400,
            f"dimensions is {dimensions}, above this model's embedding size of {len(full)}",
            param="dimensions",
            code="invalid_value",
        )
    cut = full[:dimensions]
    norm = math.sqrt(sum(v * v for v in cut))
    return [v / norm for v in cut] if norm > 0 else cut
