"""Models at run time: ``GET /v1/models`` (configured models, the models directory, aliases,
LoRA adapters served as models), the admin endpoints that load and unload them, and
llama-server's ``GET``/``POST /lora-adapters`` (``server/lora.py``).

``/v1/models`` and ``/v1/models/{id}`` answer in OpenAI's shape, or in Anthropic's to a request
with an ``anthropic-version`` header (every Anthropic SDK sends one): its ``type``,
``display_name``, ``created_at`` and ``lifecycle``, paged by ``limit`` (default 20) and
``after_id``/``before_id``. The two shapes differ where a field would clash: Anthropic's
``capabilities`` is an object of its own, so kvwarm's list of them is OpenAI-shaped only.

Invariants: ``/admin/*`` sits behind the admin key (or the API key) exactly as ``/cache/*`` does
(``server/guard.py``), and, being POSTs, behind the Origin and Host checks. Loading a file by
*path* reads any file the server can read, so it is refused unless a key is configured at all;
loading by *name* only opens a regular file inside ``models_dir`` (``kvwarm.models_dir``).
Unloading a model with requests in flight is a 409 (``ModelBusyError``), never a cut-off answer.
"""

from __future__ import annotations

import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import ConfigDict, Field, RootModel, StrictInt
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvwarm.embedded import is_file
from kvwarm.server import budget
from kvwarm.server.errors import HTTPError
from kvwarm.server.registry import ModelEntry
from kvwarm.server.schemas import JsonBody, StrictNumber, json_body, parse_body, read_json
from kvwarm.server.state import ServerState, server_state

router = APIRouter()


class LoadRequest(JsonBody):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, description="a model id, alias or models_dir name")
    path: str | None = Field(default=None, description="a GGUF file (needs a configured key)")
    id: str | None = Field(default=None, description="the id to serve a path under")


class UnloadRequest(JsonBody):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the model id (or alias) to unload")


def model_item(state: ServerState, entry: ModelEntry) -> dict[str, object]:
    """One ``/v1/models`` item: OpenAI's fields, the load state, and facts once loaded."""
    item: dict[str, object] = {
        "id": entry.id,
        "object": "model",
        "created": int(state.started),
        "owned_by": "kvwarm",
        "status": entry.state,
        "source": entry.source,
        **residency(state, entry),
    }
    if entry.model is not None and entry.state != "failed":  # failed: its worker died
        info = entry.model.info()
        # What it can be asked to do: "generate" and "embed", or a reranker's "rerank".
        item["capabilities"] = list(info.capabilities)
        item["meta"] = {
            "path": info.path,
            "backend": info.backend,
            "n_ctx": info.n_ctx,
            "n_ctx_train": info.n_ctx_train,
            "n_vocab": info.n_vocab,
            "n_embd": info.n_embd,
            "n_parallel": info.n_parallel,
            "size": info.size_bytes,
            # What it holds in memory (the memory budget's terms, server/budget.py): the
            # projector's weights and buffers, the draft model's weights and the LoRA
            # adapters' count with the model's weights (the draft model's context in
            # context_bytes).
            "weights_bytes": budget.memory_of(entry.id, entry.model).weights_bytes,
            "kv_bytes": info.kv_bytes,
            "context_bytes": info.context_bytes,
            "description": info.description,
            "fingerprint": info.fingerprint,
            "chat_template": info.chat_template,
            "chat_template_name": info.chat_template_name,
            "n_gpu_layers": info.n_gpu_layers,
            "flash_attn": info.flash_attn,
            "type_k": info.type_k,
            "type_v": info.type_v,
            # What its cached states can resume from (kvwarm.memory): an orchestrator or a
            # user can tell why a sliding-window or recurrent model reuses only checkpoints.
            "memory": {"kind": info.memory, "n_swa": info.n_swa, "swa_full": info.swa_full},
            "pooling": info.pooling,
            # Speculative decoding: the requests' default draft source, and whether (or where)
            # this model can speculate at all ("on", "on while ...", "off: why").
            "speculative": {
                "type": info.spec_type,
                "available": info.speculation,
                # Where a greedy reply is plain decoding's ("at any length", "while ...").
                "exact": info.speculation_exact,
                "draft_model": info.draft_model,
            },
            # Its multimodal projector (--mmproj): what it reads, what it holds.
            "mmproj": info.mmproj,
            "media": list(info.media),
            "projector_bytes": info.projector_bytes,
            # Its draft model's weights (--draft-model; its context is in context_bytes).
            "draft_bytes": info.draft_bytes,
            # Its LoRA adapters' weights (--lora), whatever their scales.
            "adapter_bytes": info.adapter_bytes,
        }
    elif entry.error:
        item["error"] = entry.error
    return item


def residency(state: ServerState, entry: ModelEntry) -> dict[str, object]:
    """How long the model stays loaded (as Ollama's ``/api/ps`` says it): ``pinned``,
    ``keep_alive_s`` (seconds once idle; null: for ever) and ``expires_at`` (unix seconds it
    unloads at if no request comes; null while in use, not loaded, or never)."""
    registry = state.registry
    ttl = registry.keep_alive(entry)
    due = registry.due(entry)
    expires = None if due is None else int(time.time() + (due - time.monotonic()))
    return {
        "pinned": entry.pinned,
        "keep_alive_s": None if math.isinf(ttl) else ttl,
        "expires_at": expires,
    }


def for_anthropic(request: Request) -> bool:
    """Whether the client speaks Anthropic's API: its SDKs send ``anthropic-version`` always."""
    return "anthropic-version" in request.headers


#: OpenAI's fields, and kvwarm's list of ``capabilities``, which Anthropic's (an object of
#: supports) would contradict: left out of Anthropic's shape.
_NOT_ANTHROPIC = frozenset({"object", "created", "owned_by", "capabilities"})


def anthropic_item(state: ServerState, item: dict[str, object]) -> dict[str, object]:
    """An OpenAI-shaped model item in Anthropic's shape (``anthropic.types.ModelInfo``), with
    kvwarm's own fields after Anthropic's. ``created_at`` is the server's start, as OpenAI's
    ``created`` is (Anthropic's is a release date, "an epoch value if unknown")."""
    meta = item.get("meta")
    n_ctx = meta.get("n_ctx") if isinstance(meta, dict) else None
    limit = state.settings.max_tokens_limit
    started = datetime.fromtimestamp(int(state.started), UTC)
    head: dict[str, object] = {
        "type": "model",
        "id": item["id"],
        "display_name": item["id"],
        "created_at": started.isoformat().replace("+00:00", "Z"),
        "lifecycle": "active",
        # Known once loaded: its context, and the most a reply may ask for within it.
        "max_input_tokens": n_ctx if isinstance(n_ctx, int) else None,
        "max_tokens": min(limit, n_ctx) if isinstance(n_ctx, int) else limit,
    }
    return head | {k: v for k, v in item.items() if k not in _NOT_ANTHROPIC and k not in head}


_MAX_PAGE = 1000  # Anthropic's bound on a list's limit


def _page(
    data: list[dict[str, object]],
    anthropic: bool,
    limit: int | None,
    after: str | None,
    before: str | None,
) -> dict[str, object]:
    """``data`` as one list page: Anthropic's ``limit`` (default 20 for an Anthropic client,
    every model otherwise) and ``after_id``/``before_id`` cursors, with ``has_more``,
    ``first_id`` and ``last_id`` (OpenAI's clients ignore them)."""
    if limit is None:
        limit = 20 if anthropic else len(data)
    if after is not None and before is not None:
        raise HTTPError(
            400, "give after_id or before_id, not both", param="before_id", code="invalid_value"
        )
    ids = [item["id"] for item in data]

    def at(param: str, value: str) -> int:
        if value not in ids:
            raise HTTPError(
                400, f"{param}: no model has id {value!r}", param=param, code="invalid_value"
            )
        return ids.index(value)

    if before is not None:
        end = at("before_id", before)
        start = max(0, end - limit)
        more = start > 0
    else:
        start = at("after_id", after) + 1 if after is not None else 0
        end = min(len(data), start + limit)
        more = end < len(data)
    page = data[start:end]
    listed: dict[str, object] = {} if anthropic else {"object": "list"}
    return listed | {
        "data": page,
        "has_more": more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


@router.get("/v1/models")
async def list_models(
    request: Request,
    limit: Annotated[
        int | None,
        Query(
            ge=1,
            le=_MAX_PAGE,
            description="most models to list (Anthropic's; default: 20 for an Anthropic "
            "client, all otherwise)",
        ),
    ] = None,
    after_id: Annotated[
        str | None, Query(description="list the models after this one (Anthropic's cursor)")
    ] = None,
    before_id: Annotated[
        str | None, Query(description="list the models before this one (Anthropic's cursor)")
    ] = None,
) -> Response:
    """Every model the server knows, in OpenAI's shape or, for an Anthropic client, in
    Anthropic's (a page at a time)."""
    state = server_state(request)
    state.registry.rescan()  # new files in models_dir appear (one listdir, under the lock)
    data = [model_item(state, entry) for entry in list(state.entries.values())]
    for alias, target in state.registry.aliases.items():
        entry = state.entries.get(target)
        if entry is not None:
            data.append({**model_item(state, entry), "id": alias, "alias_of": target})
    data += [
        adapter_item(state, adapter.name)
        for adapter in state.lora.by_name.values()
        if adapter.model in state.entries
    ]
    anthropic = for_anthropic(request)
    if anthropic:
        data = [anthropic_item(state, item) for item in data]
    return JSONResponse(_page(data, anthropic, limit, after_id, before_id))


def adapter_item(state: ServerState, name: str) -> dict[str, object]:
    """A LoRA adapter served as a model, as vLLM lists one: its file as ``root``, its model
    as ``parent``; loaded, ready or failed with it."""
    adapter = state.lora.by_name[name]
    entry = state.entries[adapter.model]
    return {
        "id": adapter.name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "kvwarm",
        "root": adapter.path,
        "parent": adapter.model,
        "status": entry.state,
        "source": "lora",
        "lora": {"id": adapter.id, "path": adapter.path},
    }


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> Response:
    """One model (an id or an alias), as OpenAI's ``models.retrieve`` returns it, or
    Anthropic's for an Anthropic client; 404 ``model_not_found``."""
    state = server_state(request)
    registry = state.registry
    anthropic = for_anthropic(request)

    def shaped(item: dict[str, object]) -> dict[str, object]:
        return anthropic_item(state, item) if anthropic else item

    if model_id in state.lora.by_name and model_id not in state.entries:
        return JSONResponse(shaped(adapter_item(state, model_id)))
    target = registry.aliases.get(model_id, model_id)
    registry.rescan()  # new files of models_dir; models whose worker died show failed
    entry = state.entries.get(target)
    if entry is None:
        raise HTTPError(
            404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
        )
    item = model_item(state, entry)
    return JSONResponse(
        shaped(item if target == model_id else {**item, "id": model_id, "alias_of": target})
    )


@router.post("/admin/models/load", openapi_extra=json_body(LoadRequest))
async def load_model(request: Request) -> Response:
    """Load a model and answer once it is ready (a failed one is retried)."""
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), LoadRequest)
    if (req.name is None) == (req.path is None):
        raise HTTPError(400, "give exactly one of name or path", code="invalid_value", param="name")
    if req.id is not None and req.path is None:
        raise HTTPError(
            400,
            "id names a model loaded by path; a name keeps its own id",
            code="invalid_value",
            param="id",
        )
    path = None
    if req.path is not None:
        if not (state.settings.admin_key or state.settings.api_key):
            raise HTTPError(
                403,
                "loading a model by path needs an admin key or an API key on this server "
                "(--admin-key); load by name from --models-dir instead",
                code="key_required",
                param="path",
            )
        path = Path(os.path.expanduser(req.path))
        # A typo is the caller's to fix, not a load to retry (503); and so is a path no stat
        # can answer (a name too long, a directory not searchable: found by review, a 500).
        if not is_file(path):
            raise HTTPError(
                404, f"no model file at {req.path!r}", param="path", code="model_not_found"
            )
    model_id = await state.registry.admin_load(req.name, path, req.id)
    return JSONResponse(model_item(state, state.entries[model_id]))


@router.post("/admin/models/unload", openapi_extra=json_body(UnloadRequest))
async def unload_model(request: Request) -> Response:
    """Unload a model (bounded shutdown saves); its next request loads it again."""
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), UnloadRequest)
    entry = state.registry.begin_unload(req.model)
    if entry is not None:
        await run_in_threadpool(state.registry.finish_unload, entry)
    target = state.registry.aliases.get(req.model, req.model)
    entry = state.entries.get(target)
    return JSONResponse(model_item(state, entry) if entry else {"id": req.model})


# --- llama-server's /lora-adapters ------------------------------------------------------------


class LoraScale(JsonBody):
    model_config = ConfigDict(extra="forbid")

    id: StrictInt = Field(
        ge=0, le=(1 << 31) - 1, description="the adapter's id (GET /lora-adapters)"
    )
    scale: StrictNumber = Field(default=0.0, description="its global scale (0: off)")


class LoraScales(RootModel[list[LoraScale]]):
    """llama-server's body: every adapter's global scale; one not listed is set to 0."""

    root: list[LoraScale] = Field(max_length=64)


def _lora_model(state: ServerState, model: str | None) -> str:
    """The model a ``/lora-adapters`` call is about: ``model`` (an id, alias or adapter name),
    else the default model (llama-server serves one)."""
    name = model or state.registry.default_id
    if name is None:
        raise HTTPError(
            400, "this server has no default model: name one", code="invalid_value", param="model"
        )
    base = state.lora.base_of(name)
    if base is not None:
        return base
    target = state.registry.aliases.get(name, name)
    if target not in state.entries:
        raise HTTPError(
            404, f"the model {name!r} does not exist", param="model", code="model_not_found"
        )
    return target


@router.get("/lora-adapters")
async def list_lora_adapters(request: Request, model: str | None = None) -> Response:
    """A model's LoRA adapters by id, with their global scales (its ``lora`` setting's
    order); the model need not be loaded."""
    state = server_state(request)
    return JSONResponse(state.lora.listing(_lora_model(state, model)))


@router.post("/lora-adapters", openapi_extra=json_body(LoraScales))
async def set_lora_adapters(request: Request, model: str | None = None) -> Response:
    """Set a model's global adapter scales: what its requests without a ``lora`` list of
    their own run under, from the next request on (running ones keep theirs)."""
    state = server_state(request)
    data = await read_json(request, state.settings)
    if not isinstance(data, list):
        raise HTTPError(
            400,
            'the body is a list of adapters, e.g. [{"id": 0, "scale": 0.5}]',
            code="invalid_json",
        )
    body = parse_body({"root": data}, _LoraScalesBody)
    target = _lora_model(state, model)
    state.lora.set_scales(target, [(item.id, item.scale) for item in body.root])
    return JSONResponse({"success": True})


class _LoraScalesBody(JsonBody):
    """``LoraScales`` under a key, so ``parse_body`` names the offending item's field."""

    model_config = ConfigDict(extra="forbid")

    root: list[LoraScale] = Field(max_length=64)
