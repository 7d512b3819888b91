"""Fill-in-the-middle prompts from a model's FIM tokens, as llama-server assembles them.

The layout (prefix-suffix-middle): ``[extra context] [BOS] FIM_PRE prefix prompt FIM_SUF
suffix FIM_MID``; the model then generates the middle. Extra context files go first, each as
``FIM_SEP filename\\n text`` (after ``FIM_REP project\\n`` when the vocabulary has it), or
separated by a plain ``--- snippet ---`` line when it has no file separator.

Invariant: text never becomes special tokens (``parse_special=False``), so a prefix that
contains ``<fim_middle>`` stays text; a model without FIM tokens is a ``FimNotSupportedError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvwarm.backends.base import BackendModel
from kvwarm.errors import FimNotSupportedError


@dataclass(frozen=True, slots=True)
class ExtraFile:
    """A file of extra context for an infill (llama-server's ``input_extra`` item)."""

    text: str
    filename: str = "tmp"


def fim_tokens(
    model: BackendModel,
    prefix: str,
    suffix: str,
    *,
    prompt: str = "",
    extra: Sequence[ExtraFile] = (),
) -> list[int]:
    """The prompt tokens that ask ``model`` for the text between ``prefix`` (+ ``prompt``,
    the start of the middle already written) and ``suffix``."""
    fim = model.facts.fim
    if fim is None:
        raise FimNotSupportedError(
            "this model has no fill-in-the-middle tokens (FIM_PRE/FIM_SUF/FIM_MID), so it "
            "cannot complete with a suffix",
            param="suffix",
        )

    def text(value: str) -> list[int]:
        return model.tokenize(value, add_special=False, parse_special=False)

    tokens: list[int] = []
    if extra:
        if fim.rep is not None:
            tokens += [fim.rep, *text("myproject\n")]
        for item in extra:
            if fim.sep is not None:
                tokens += [fim.sep, *text(item.filename + "\n")]
            else:
                tokens += text("\n\n--- snippet ---\n\n")
            tokens += text(item.text)
        if fim.sep is not None:
            tokens += [fim.sep, *text("filename\n")]
    bos = model.facts.bos
    if model.facts.add_bos and bos is not None:
        tokens.append(bos)
    tokens += [fim.pre, *text(prefix), *text(prompt), fim.suf, *text(suffix), fim.mid]
    return tokens
