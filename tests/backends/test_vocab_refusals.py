"""A model whose vocabulary llama.cpp cannot tokenize with is refused at load (found by review):
llama.cpp loads it, then GGML_ASSERTs in every tokenize, so the first prompt sent to one an
engine had loaded (a models_dir file a request names) aborted the process.

- no vocabulary (tokenizer ``none``, as audio decoders ship): every tokenize and
  token_to_piece asserts;
- a vocabulary that adds a special token it does not have (a T5 tokenizer, which has no BOS,
  whose GGUF says ``add_bos_token``): every tokenize with the model's specials asserts.

The engine runs in a child process, so an abort fails one test instead of the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.childkit import assert_case_ok
from tests.tinymodels import _arch_keys, write_tiny_model

from kvwarm.backends.llama import LlamaBackend
from kvwarm.errors import InvalidRequestError, ModelLoadError

pytestmark = pytest.mark.model


_ENGINE = """
import sys
import kvwarm
from kvwarm.errors import InvalidRequestError, ModelLoadError
with kvwarm.Engine() as engine:
    try:
        model = engine.load_model(sys.argv[1])
    except ModelLoadError as exc:
        print("refused:", exc)
        print("CASE-OK")
        raise SystemExit(0)
    model.complete("hello", max_tokens=1)  # what aborted: the prompt's tokenize
    raise SystemExit("loaded and served")
"""


def _adds_bos(w: Any, arch: str) -> None:
    _arch_keys(w, arch)
    w.add_bool("tokenizer.ggml.add_bos_token", True)


#: (tokenizer, extra keys, what the refusal says)
CASES = {
    "no-vocabulary": ("none", None, "no vocabulary"),
    "t5-adds-a-bos-it-lacks": ("t5", _adds_bos, "adds BOS"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str]:
    tokenizer, keys, says = CASES[str(request.param)]
    out = tmp_path_factory.mktemp("vocab") / f"{request.param}.gguf"
    return str(write_tiny_model(out, "mamba", keys=keys, tokenizer=tokenizer)), says


def test_the_backend_refuses_it(case: tuple[str, str]) -> None:
    path, says = case
    with pytest.raises(ModelLoadError, match=says):
        LlamaBackend().load_model(path)


def test_an_engine_load_is_a_typed_error(case: tuple[str, str]) -> None:
    assert_case_ok("-c", _ENGINE, case[0])


def test_a_text_the_tokenizer_cannot_spell_is_a_typed_error(tmp_path: Path) -> None:
    """An RWKV vocabulary of no token for "hello" tokenized it as -1 (LLAMA_TOKEN_NULL), which
    went on as a prompt token (found by review): the tokenize itself now says why."""
    from tests.tinymodels import N_VOCAB, write_reranker

    def rwkv(w: Any) -> int:
        w.add_string("tokenizer.ggml.model", "rwkv")
        w.add_array("tokenizer.ggml.tokens", [f"tok_{i}" for i in range(N_VOCAB)])
        w.add_array("tokenizer.ggml.token_type", [1] * N_VOCAB)
        return N_VOCAB

    path = write_reranker(tmp_path / "rwkv.gguf", "decoder", template=None, tokenizer=rwkv)
    model = LlamaBackend().load_model(str(path))
    try:
        with pytest.raises(InvalidRequestError, match="cannot spell the text"):
            model.tokenize("hello")
        assert model.tokenize("tok_1", add_special=False) == [1]
    finally:
        model.close()
