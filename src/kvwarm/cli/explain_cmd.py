"""``kvwarm cache explain``: why a prompt would (not) come from the cache, without a server.

It tokenizes the prompt (text, or a request body's ``messages`` rendered with the model's chat
template) with the model's vocabulary alone (``ModelParams.vocab_only``: no weights, no
context), derives the cache namespace the server would use (the model's fingerprint, its
quantisation, the context parameters the settings give, the salt), and runs the planner's own
reasoning (``engine/worker/explain.explain_prompt``) against the cache directory, opened
read-only. It prints the same ``MissReason`` the server's ``timings.cache_reason`` carries.

Differences from a live server, by nature: no slot holds live KV here, and this process
remembers no eviction (``MissHistory`` is per process), so a row evicted by the server reads
as ``no_prefix`` or ``new_tokens``. As the operator's tool it looks in *every* namespace of the
cache (other models, adapter sets, contexts and salts), which the server never tells a client.

The namespace hashes the matrix kernels the server's model computes with
(``BackendModel.kernels``), which depend on every model the server may load: ``kvwarm serve``
turns llama.cpp's tiled kernel off for its whole process where one of them will speculate with
K-quant weights. So explain takes the server's whole configuration, decides the kernels with
the function ``serve`` calls (``common.decide_kernels``), and explains the model ``--model-id``
names. A model an admin loaded later, by path, is not in the configuration.

A tenant of a server with ``cache_salt_from_auth`` (``--tenant-key-env``, ``--tenant-key-stdin``,
``--tenant-id``, ``--anonymous``) is named as the server names it (``kvwarm.tenants``); a key
is never taken from the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvwarm.cli.common import (
    MODEL_SETTINGS,
    add_settings,
    chosen_model,
    decide_kernels,
    settings_from,
)
from kvwarm.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from kvwarm.backends.base import BackendModel
    from kvwarm.server.tools import ChatPlan


def register(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    help_text = "why a prompt would or would not be served from the cache (no model loaded)"
    parser = actions.add_parser(
        "explain",
        help=help_text,
        description=help_text + ": tokenizes with the model's vocabulary only and runs the "
        "planner's reasoning against the cache directory.",
    )
    parser.add_argument("prompt", nargs="?", help="the prompt text (or give --body)")
    parser.add_argument(
        "--body",
        type=Path,
        metavar="FILE",
        help="a request body (JSON): its 'messages' with its 'tools' and 'tool_choice' (a "
        "chat, rendered as the server renders it) or 'prompt'; its 'cache_salt' unless --salt "
        "is given",
    )
    parser.add_argument("--salt", default=None, help="the request's cache salt")
    parser.add_argument(
        "--model-id",
        metavar="ID",
        default=None,
        help="which configured model the request is for (its id; default: the first, the "
        "server's default); give the server's whole configuration, every model of it: its "
        "cache keys depend on what else the server loads",
    )
    tenant = parser.add_argument_group(
        "tenant (a server with cache_salt_from_auth: each API key's requests run in a scope "
        "of their own, and --salt partitions it further); never give a key on the command line"
    )
    who = tenant.add_mutually_exclusive_group()
    who.add_argument(
        "--tenant-key-env",
        metavar="VAR",
        help="the tenant's API key is in environment variable VAR",
    )
    who.add_argument(
        "--tenant-key-stdin",
        action="store_true",
        help="read the tenant's API key from the first line of standard input",
    )
    who.add_argument(
        "--tenant-id",
        metavar="HEX",
        help="the tenant's id (the key's digest, 64 hex digits, as the JSON output's "
        "'tenant_id' gives it): no key needed",
    )
    who.add_argument(
        "--anonymous",
        action="store_true",
        help="a request presenting no key (its --salt is scoped as anonymous)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    # The kernels are decided over the server's models_dir too (``decide_kernels``): found by
    # review, its flags were refused here, so the server's command line could not be given.
    add_settings(parser, (*MODEL_SETTINGS, "models_dir", "aliases"))
    parser.set_defaults(run=run_explain)


def _read_body(path: Path) -> Mapping[str, object]:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"--body {path}: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError(f"--body {path}: a JSON object is expected")
    return body


def run_explain(args: argparse.Namespace) -> int:
    from kvwarm.backends import get_backend
    from kvwarm.cache.explain import describe, reuse_json
    from kvwarm.cache.formats.key import salted_namespace
    from kvwarm.cache.types import Namespace
    from kvwarm.cli.cache_cmd import open_cache, require_dirs
    from kvwarm.engine.fingerprint import model_fingerprint, parse_mode
    from kvwarm.engine.speculating import needs_exact_rows
    from kvwarm.engine.worker.explain import explain_prompt
    from kvwarm.memory import MemoryKind
    from kvwarm.settings.model import model_config
    from kvwarm.tenants import scoped_by_id

    settings = settings_from(args)
    body = _read_body(args.body) if args.body is not None else {}
    # Whether --body was given, not whether its object is empty (found by review: ``{}``
    # counted as no body).
    if (args.prompt is None) == (args.body is None):
        raise ConfigError("give a prompt or --body FILE (one of them)")
    if not settings.models:
        raise ConfigError("no model to explain against: give --model")
    spec = chosen_model(settings.models, args.model_id)
    cfg = model_config(settings, spec)
    chosen = cfg.backend or settings.backend
    backend = get_backend(chosen) if isinstance(chosen, str) else chosen
    path = backend.locate(spec.path)
    salt = args.salt if args.salt is not None else body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError("cache_salt must be a string", param="cache_salt")
    tenant = _tenant(args)
    if tenant is not None or args.anonymous:
        salt = scoped_by_id(salt, tenant)
    require_dirs(settings)  # before loading a model: a mistyped --cache-dir is the answer
    # Loaded as the server loads it: its kernels (``BackendModel.kernels``) are hashed into
    # the namespace, and they are the process's (decided over every model the server may
    # load, by the function ``kvwarm serve`` calls) and the load's (unrepacked where it will
    # verify drafts exactly).
    decide_kernels(settings)
    exact_rows = needs_exact_rows(cfg, path)
    vocab = dataclasses.replace(cfg.model_params, vocab_only=True, exact_rows=exact_rows)
    bmodel = backend.load_model(str(path), vocab)
    try:
        facts = bmodel.facts
        tokens = _tokens(bmodel, args.prompt, body, cfg.chat_template)
        # The namespace the server hashed: its context as it ran (flash attention resolved).
        context = bmodel.context_params(
            cfg.context,
            deterministic=cfg.deterministic,
            speculative=cfg.speculates_with(facts.pooling),
            exact=cfg.spec_exact,
        )
        kernels = bmodel.kv_tag(context, deterministic=cfg.deterministic)
    finally:
        bmodel.close()
    fingerprint = model_fingerprint(path, parse_mode(cfg.fingerprint_mode), cfg.fingerprint)
    base = Namespace(fingerprint, facts.file_type & 0xFF, context.kv_hash(kernels))
    namespace = salted_namespace(base, None if salt is None else salt.encode("utf-8"))
    memory = MemoryKind(facts.memory_kind, facts.n_swa, cfg.context.swa_full)
    with open_cache(settings, repair=False) as cache:
        spaces = list(dict.fromkeys(r.namespace for r in cache.rows()))
        report = explain_prompt(
            cache,
            tokens,
            namespace=namespace,
            others=[ns for ns in spaces if ns != namespace],
            n_batch=cfg.context.n_batch,
            deterministic=cfg.deterministic,
            memory=memory,
        )
        n_rows = len(cache.rows(namespace))
    if report.detail == "context":  # here, unlike in the server, a salt may be what differs
        report = dataclasses.replace(report, detail="context or salt")
    if args.json:
        out = {
            **({} if tenant is None else {"tenant_id": tenant}),
            "prompt_tokens": len(tokens),
            "rows_in_namespace": n_rows,
            "namespaces": len(spaces),
            **reuse_json(report),
        }
        print(json.dumps(out, indent=2))
        return 0
    # "(1 in all)" after a row count read as one row in all, beside "4 rows in its namespace".
    spaces_text = f"{len(spaces)} namespace{'' if len(spaces) == 1 else 's'} in the cache"
    print(f"prompt: {len(tokens)} tokens; {n_rows} rows in its namespace ({spaces_text})")
    print(describe(report))
    return 0


def _tenant(args: argparse.Namespace) -> str | None:
    """The tenant id the tenant options name (None: none given). A key is read from the
    environment or standard input, never from the command line (where ``ps`` and the shell's
    history show it), and as the server reads a header's bytes: UTF-8, any other bytes kept."""
    from kvwarm.tenants import is_tenant_id, tenant_id

    if args.tenant_id is not None:
        value = str(args.tenant_id).strip().lower()
        if not is_tenant_id(value):
            raise ConfigError("--tenant-id must be 64 hex digits")
        return value
    if args.tenant_key_env is not None:
        raw = os.fsencode(os.environ.get(args.tenant_key_env, ""))
        where = f"environment variable {args.tenant_key_env}"
    elif args.tenant_key_stdin:
        raw = sys.stdin.buffer.readline().rstrip(b"\r\n")
        where = "standard input"
    else:
        return None
    key = raw.decode("utf-8", "surrogateescape")
    if not key:
        raise ConfigError(f"no API key in {where}")
    return tenant_id(key)


class _Template:
    """The model's chat template as the server's chat planning asks it (``ChatTemplate``)."""

    def __init__(self, bmodel: BackendModel, template: str | None) -> None:
        self._bmodel = bmodel
        self._template = template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return self._bmodel.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template=self._template,
        )


def _chat_plan(template: _Template, body: Mapping[str, object]) -> ChatPlan:
    """The chat a body's ``messages``, ``tools`` and ``tool_choice`` make, planned as the
    server's chat completions plan it (``server/chat.plan_messages``): tools the template does
    not show are described in the system message, calls in the history rendered as text."""
    from kvwarm.server.chat import plan_messages
    from kvwarm.server.errors import HTTPError
    from kvwarm.server.schemas import ChatRequest, parse_body

    fields = ("messages", "tools", "tool_choice", "parallel_tool_calls")
    try:
        req = parse_body({k: body[k] for k in fields if k in body}, ChatRequest)
        return plan_messages(
            template, req.messages, req.tools, req.tool_choice, parallel=req.parallel_tool_calls
        )
    except HTTPError as exc:
        raise InvalidRequestError(f"--body: {exc.message}", param=exc.param) from None


def _tokens(
    bmodel: BackendModel, prompt: str | None, body: Mapping[str, object], chosen: str | None
) -> Sequence[int]:
    """The prompt's tokens as the server would make them."""
    from kvwarm.backends.chat_template import BUILTIN_TEMPLATES, FALLBACK_TEMPLATE, resolve_template
    from kvwarm.engine.prompts import chat_tokens

    if prompt is not None:
        return bmodel.tokenize(prompt, add_special=True, parse_special=True)
    if body.get("messages") is not None:
        template: str | None = None
        if chosen is not None:
            template = resolve_template(chosen)[1]
        elif not bmodel.facts.chat_template:
            template = BUILTIN_TEMPLATES[FALLBACK_TEMPLATE]
        plan = _chat_plan(_Template(bmodel, template), body)
        tokens, _ = chat_tokens(bmodel, plan.messages, tools=plan.tools, template=template)
        return tokens
    text = body.get("prompt")
    if not isinstance(text, str):
        raise InvalidRequestError("the body needs 'messages' or a string 'prompt'", param="body")
    return bmodel.tokenize(text, add_special=True, parse_special=True)
