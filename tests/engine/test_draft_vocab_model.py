"""A draft model whose vocabulary is a few tokens longer or shorter than the model's, as llama.cpp
accepts (``check_vocab``; Qwen2.5 0.5B's 151,936 tokens beside 7B's 152,064), on tiny llama
models that write fixed chains of tokens (``write_marker_model``'s ``after``) with certainty, so
a draft model of the same chains drafts them: the reply is plain decoding's, a draft token the
model does not have ends the draft, and a token the draft model does not have is never fed
to it (llama.cpp would read past its embeddings).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from tests.engine.conftest import make_engine
from tests.tinymodels import write_marker_model

from kvwarm.backends.base import ContextParams
from kvwarm.engine.api import Engine, ModelConfig
from kvwarm.engine.types import GenerationOptions

#: Drafts made whatever they cost: the draft models are as large as the model.
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("free_draft_passes")]

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
GREEDY = GenerationOptions(max_tokens=24, temperature=0.0)
SAMPLED = GenerationOptions(max_tokens=24, temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=3)
CHAIN = {"hi": "ho", "ho": "hi"}
#: Token ids: after <unk> <s> </s>, the 256 bytes and the 10 markers, the extra tokens.
HI, HO, P1 = 269, 270, 271
#: BOS and "hi": a prompt the chain goes on from with certainty (the first token after a
#: prompt of text is a near tie, where the KV cell types could tip it).
PROMPT = [1, HI]
DRAFTS = "kvwarm.engine.worker.draftmodel"  # its logger: a draft context's failure a WARNING


def _model(directory: Path, name: str, extra: tuple[str, ...], after: Mapping[str, str]) -> str:
    path = directory / f"{name}.gguf"
    return str(write_marker_model(path, TEMPLATE, ("hi",), extra=extra, after=after))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("draftpairs-vocab")
    return {
        # The model: 271 tokens, writing "hi ho hi ho ..." (then "hi ho p1" where it has p1).
        "model": _model(d, "model", ("hi", "ho"), CHAIN),
        "model+p1": _model(d, "model-p1", ("hi", "ho", "p1"), {**CHAIN, "ho": "p1", "p1": "hi"}),
        # Draft models of the same chain, three tokens more (padding, as Qwen2.5 7B's) ...
        "draft+3": _model(d, "draft-3", ("hi", "ho", "p1", "p2", "p3"), CHAIN),
        # ... one whose chain runs on into a token the model does not have ...
        "draft->p2": _model(d, "draft-p2", ("hi", "ho", "p1", "p2", "p3"), {**CHAIN, "ho": "p2"}),
        # ... and one of 129 tokens more: refused, as llama.cpp refuses it.
        "draft+129": _model(d, "draft-129", ("hi", "ho", *(f"x{i}" for i in range(129))), CHAIN),
    }


@pytest.fixture
def engine() -> Iterator[Engine]:
    with make_engine() as eng:
        yield eng


def _config(draft: str) -> ModelConfig:
    return ModelConfig(
        context=ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_threads=2),
        draft_model=draft,
        spec_draft_max=8,
        spec_exact=False,  # what is compared here is the draft, not the kernels' rows
    )


def test_a_draft_model_of_a_few_more_tokens_drafts(engine: Engine, models: dict[str, str]) -> None:
    """Found on main: refused ("has 274 tokens, the model 271")."""
    m = engine.load_model(models["model"], config=_config(models["draft+3"]))
    plain = m.complete(PROMPT, GREEDY, spec_type="none", cache_salt="plain")
    spec = m.complete(PROMPT, GREEDY, cache_salt="draft")
    assert plain.completion_tokens[:3] == (HO, HI, HO)  # ``after``'s chain
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.logprobs == plain.logprobs
    assert spec.stats.accepted_tokens >= 12  # the draft model's chain is the model's
    sampled = [
        m.complete(PROMPT, SAMPLED, spec_type=t, cache_salt=t) for t in ("none", "draft-simple")
    ]
    assert sampled[0].completion_tokens == sampled[1].completion_tokens
    assert sampled[1].stats.accepted_tokens > 0


def test_a_draft_token_the_model_does_not_have_ends_the_draft(
    engine: Engine, models: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The draft model's chain runs on from "ho" into p2, past the model's vocabulary: each
    draft stops before it (never a token id the model would be asked to decode)."""
    m = engine.load_model(models["model"], config=_config(models["draft->p2"]))
    plain = m.complete(PROMPT, GREEDY, spec_type="none", cache_salt="plain")
    with caplog.at_level(logging.INFO, logger="kvwarm"):
        spec = m.complete(PROMPT, GREEDY, cache_salt="draft")
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens > 0  # "ho" after "hi", never p2 after "ho"
    assert spec.stats.drafted_tokens == spec.stats.accepted_tokens
    assert not [r for r in caplog.records if r.name == DRAFTS and r.levelno >= logging.WARNING]


def test_a_token_the_draft_model_does_not_have_is_never_fed_to_it(
    engine: Engine, models: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The model writes "hi ho p1 ...", p1 a token past the draft model's vocabulary (four
    fewer tokens): the request drafts until p1 is in its text, then no more, and the draft
    context never decodes it (a failure would be logged as a WARNING); so for a prompt that
    holds such a token."""
    m = engine.load_model(models["model+p1"], config=_config(models["model"]))
    with caplog.at_level(logging.INFO, logger="kvwarm"):
        plain = m.complete(PROMPT, GREEDY, spec_type="none", cache_salt="plain")
        spec = m.complete(PROMPT, GREEDY, cache_salt="draft")
        assert plain.completion_tokens[:3] == (HO, P1, HI)
        assert spec.completion_tokens == plain.completion_tokens
        assert spec.stats.drafted_tokens > 0
        prompt = [1, HI, HO, P1]
        fed = m.complete(prompt, GREEDY, cache_salt="p1")
        again = m.complete(prompt, GREEDY, spec_type="none", cache_salt="p1 plain")
        assert fed.completion_tokens == again.completion_tokens and fed.stats.drafted_tokens == 0
    assert not [r for r in caplog.records if r.name == DRAFTS and r.levelno >= logging.WARNING]
    assert sum("does not have token" in r.getMessage() for r in caplog.records) == 2


def test_a_draft_model_of_129_more_tokens_is_refused(
    engine: Engine, models: dict[str, str]
) -> None:
    from kvwarm.errors import ConfigError

    with pytest.raises(ConfigError, match="at most 128 tokens more or fewer"):
        engine.load_model(models["model"], config=_config(models["draft+129"]))
