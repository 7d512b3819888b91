"""Submitting: a request is built, checked and queued on the caller's thread.

Invariants (``docs/architecture.md``, "Engine"): a queued request's prompt fits the context and
its grammar and bias compile, so the worker only sees requests it can run; a ``parent_key``
wait happens here and never stalls other slots; ``n`` choices are one queued request carrying
``n - 1`` forks, ``n`` at most ``n_parallel``, choice ``i`` seeded with ``seed + i``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvwarm.backends.base import BackendModel, json_schema_to_grammar
from kvwarm.backends.grammar_cost import cheap_grammar
from kvwarm.cache.api import CacheApi
from kvwarm.cache.types import PolicyConfig, TtlClass
from kvwarm.engine.config import ModelConfig
from kvwarm.engine.prompts import MediaPrompt
from kvwarm.engine.request import Request, RequestKind, check_length
from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.types import RANDOM_SEED, GenerationOptions, sampler_seed
from kvwarm.engine.worker.loop import Worker
from kvwarm.engine.worker.runtime import LoraChoice
from kvwarm.errors import InvalidRequestError


def choice_options(opts: GenerationOptions, n: int, limit: int) -> list[GenerationOptions]:
    """The options of each of ``n`` choices: choice ``i`` samples with ``seed + i`` (modulo
    ``RANDOM_SEED``); with no seed, or a random one, each draws its own."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
        raise InvalidRequestError(
            f"n must be between 1 and {limit} (this model's n_parallel slots); got {n!r}",
            param="n",
        )
    base = sampler_seed(opts.seed)
    if base is None:  # each choice draws its own
        return [opts] * n
    # Never RANDOM_SEED: a choice landing on it would not be reproducible.
    return [replace(opts, seed=(base + i) % RANDOM_SEED) for i in range(n)]


def preserved_ids(bmodel: BackendModel, texts: Sequence[str]) -> frozenset[int]:
    """The tokens a reply writes the text of although they are special: each of ``texts``
    (``GenerationOptions.preserved_tokens``) that the vocabulary holds as one token, as
    llama-server resolves its ``preserved_tokens``. A text of several tokens is plain text in
    the reply anyway."""
    kept: set[int] = set()
    for text in texts:
        ids = bmodel.tokenize(text, add_special=False, parse_special=True)
        if len(ids) == 1:
            kept.add(ids[0])
    return frozenset(kept)


@dataclass(frozen=True, slots=True)
class Submitter:
    bmodel: BackendModel
    worker: Worker
    cache: CacheApi
    config: ModelConfig
    policy: PolicyConfig
    #: ``AdapterError`` for a request's LoRA set naming an adapter the model lacks.
    check_lora: Callable[[LoraChoice | None], None] = lambda _choice: None
    #: The media kinds whose spans are decoded in one ubatch (the projector's).
    non_causal: tuple[str, ...] = ()

    def group(
        self, prompt: MediaPrompt, opts: GenerationOptions, text: str, n: int, fragments: bool
    ) -> list[CompletionStream]:
        """``n`` choices of one prompt, prefilled once."""
        choices = choice_options(opts, n, self.config.n_parallel)
        first = self.one(prompt, choices[0], text, fragments=fragments, forks=choices[1:])
        return [first] + [
            CompletionStream(f, self.worker.cancel, head=first) for f in first.request.forks
        ]

    def one(
        self,
        given: MediaPrompt,
        opts: GenerationOptions,
        text: str,
        kind: RequestKind = "generate",
        ttl: TtlClass = TtlClass.SHORT,
        *,
        fragments: bool = True,
        forks: Sequence[GenerationOptions] = (),
        upkeep: bool = False,
    ) -> CompletionStream:
        """Queue one request (with ``forks``: the options of its other choices; ``upkeep``:
        ``Request.upkeep``)."""
        prompt = given.prompt
        check_length(prompt.tokens, self.config.context.n_ctx)
        self.check_lora(opts.lora)
        if opts.spec_type == "draft-simple" and self.config.draft_model is None:
            raise InvalidRequestError(
                "spec_type 'draft-simple' needs a draft model, and this model has none "
                "(load it with --draft-model)",
                param="spec_type",
            )
        if prompt.spans:
            self._check_spans(given, opts)
        grammar = opts.grammar
        if opts.json_schema is not None:
            grammar = json_schema_to_grammar(opts.json_schema, opts.salt_bytes())
        if grammar is not None:
            # Before any backend compiles it: an explosively ambiguous or wide grammar is a
            # 400 here, never minutes of native work on the worker (issues 23, 41); an enum's
            # literals become a prefix tree llama.cpp checks cheaply.
            grammar = cheap_grammar(grammar, opts.salt_bytes())
        deterministic = (
            opts.deterministic if opts.deterministic is not None else self.config.deterministic
        )
        if deterministic and not self.config.deterministic and self.config.n_parallel > 1:
            # Its slot's cells would share one KV buffer with the other slots', and where they
            # sit changes how attention sums: bit-identical results need the per-slot KV
            # streams a deterministic model is loaded with.
            raise InvalidRequestError(
                f"this model's {self.config.n_parallel} slots share one KV buffer, so a "
                "deterministic request cannot be bit-identical here; load the model with "
                "deterministic=true (--deterministic) or n_parallel=1",
                param="deterministic",
            )
        if deterministic and self.config.context.flash_attn == "off":
            # Without flash attention llama.cpp's attention is not invariant to where a
            # sequence's cells sit in the buffer: restored rows' hits differed from cold runs.
            raise InvalidRequestError(
                "this model runs without flash attention (flash_attn auto is off on the CPU), "
                "so a deterministic request cannot be bit-identical here; load the model with "
                "deterministic=true (--deterministic) or flash_attn=on",
                param="deterministic",
            )
        if opts.parent_key is not None:
            # Wait here, on the caller's thread, for an in-flight save of the previous turn,
            # and look for it in the shared tiers, where another process (a replica that
            # served the turn) published it: once indexed, the worker's prefix lookup finds
            # it. Never stalls other slots. That lookup is confined to the request's (salted)
            # namespace, so another salt's key is waited for at most and never restored. The
            # wait counts nothing: a row restored for the request counts as hits_resume once
            # it is seated.
            self.cache.lookup_exact_or_wait(
                opts.parent_key, self.policy.session_resume_wait_ms / 1e3
            )

        preserved = preserved_ids(self.bmodel, opts.preserved_tokens)
        predicted: tuple[int, ...] = ()
        if opts.prediction:
            # Plain text (its special-token text stays text, as a reply's would read), cut
            # to the context: a draft never reaches past it.
            ids = self.bmodel.tokenize(opts.prediction, add_special=False, parse_special=False)
            predicted = tuple(ids[: self.config.context.n_ctx])

        def request(options: GenerationOptions, others: tuple[Request, ...] = ()) -> Request:
            return Request(
                prompt=prompt,
                options=options,
                grammar=grammar,
                deterministic=deterministic,
                kind=kind,
                ttl_class=ttl,
                prompt_text=text,
                fragments=fragments,
                forks=others,
                media=given.media,
                preserved=preserved,
                predicted=predicted,
                upkeep=upkeep,
            )

        if grammar is not None or opts.logit_bias:
            # Build once here so a bad grammar or bias is the caller's error, not the worker's.
            self.bmodel.new_sampler(opts.sampling(grammar, preserved=preserved)).close()
        req = request(opts, tuple(request(f) for f in forks))  # queued from here (queue_ms)
        self.worker.submit(req)
        return CompletionStream(req, self.worker.cancel)

    def _check_spans(self, given: MediaPrompt, opts: GenerationOptions) -> None:
        """A prompt's spans are decoded whole, each in one ubatch; their positions have no
        token to score."""
        ctx = self.config.context
        both_ways = self.non_causal
        for span in given.prompt.spans:
            whole = span.kind in both_ways
            room = min(ctx.n_ubatch, ctx.n_batch) if whole else ctx.n_batch
            if span.length > room:
                raise InvalidRequestError(
                    f"an {span.kind} of {span.length} positions does not fit one "
                    f"{'ubatch' if whole else 'batch'} ({room}): it is decoded whole; load the "
                    "model with a larger n_ubatch and n_batch",
                    param="messages",
                )
        if opts.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt logprobs score each prompt token: a prompt with images or audio has "
                "positions that are no token",
                param="prompt_logprobs",
            )
