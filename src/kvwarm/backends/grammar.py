"""JSON schema → GBNF, through the converter llama-cpp-python ships.

Invariant: never loads ``libllama`` — ``llama_cpp/llama_grammar.py`` uses only the standard
library, so it is loaded from its file without executing ``llama_cpp/__init__`` (which would
dlopen the native library). Cache-only and stub processes can therefore convert schemas too.
Every failure, including malformed JSON and unsupported ``$ref``s, is a ``GrammarError``;
remote ``$ref``s are never fetched.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import cast

from kvwarm.errors import GrammarError

_MODULE_NAME = "kvwarm.backends._llama_grammar"


@functools.cache
def _converter_module() -> ModuleType:
    spec = importlib.util.find_spec("llama_cpp")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise GrammarError("llama-cpp-python is not installed; cannot convert JSON schemas")
    for location in locations:
        path = Path(location) / "llama_grammar.py"
        if path.is_file():
            file_spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
            if file_spec is None or file_spec.loader is None:
                break
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[_MODULE_NAME] = module
            file_spec.loader.exec_module(module)
            return module
    raise GrammarError("llama-cpp-python ships no llama_grammar.py; cannot convert JSON schemas")


def schema_to_gbnf(schema: Mapping[str, object] | str) -> str:
    """GBNF whose language is the JSON documents valid under ``schema``."""
    try:
        text = schema if isinstance(schema, str) else json.dumps(dict(schema))
    except RecursionError as exc:
        raise GrammarError("JSON schema nests too deeply", param="json_schema") from exc
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"JSON schema is not serialisable: {exc}", param="json_schema") from exc
    convert = cast(Callable[[str], object], _converter_module().json_schema_to_gbnf)
    try:
        grammar = convert(text)
    except RecursionError as exc:
        raise GrammarError("JSON schema nests too deeply", param="json_schema") from exc
    except Exception as exc:  # the third-party converter raises assorted types
        raise GrammarError(f"unsupported JSON schema: {exc}", param="json_schema") from exc
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError("JSON schema produced an empty grammar", param="json_schema")
    return grammar
