"""``n_indent`` on a real model (Gemma 3 270M), whose tokens hold runs of spaces and a
newline with the next line's indentation: the reply a line stop ends is the greedy reply cut
where llama-server's rule cuts it (``tests.engine.test_text.indent_cut``), its tokens the
greedy reply's first ones."""

from __future__ import annotations

import pytest
from tests.engine.test_text import indent_cut

import kvwarm

PROMPTS = (
    "def fib(n):\n    if n < 2:\n        return n\n",
    "for i in range(3):\n    print(i)\n",
)


@pytest.mark.model
def test_n_indent_cuts_the_greedy_reply_where_llama_servers_rule_does(gemma_path: str) -> None:
    stopped = 0
    with kvwarm.Engine() as engine:
        model = engine.load_model(gemma_path, n_ctx=512)
        for prompt in PROMPTS:
            plain = model.complete(prompt, max_tokens=60, temperature=0)
            for n_indent in (4, 8):
                cut = model.complete(prompt, max_tokens=60, temperature=0, n_indent=n_indent)
                assert cut.text == indent_cut(plain.text, n_indent)
                n = len(cut.completion_tokens)
                assert cut.completion_tokens == plain.completion_tokens[:n]
                if cut.stats.stopped_by == "n_indent":
                    stopped += 1
                    assert n < len(plain.completion_tokens) and cut.text != plain.text
    assert stopped >= 2  # the rule fired on this model's replies, not only on the stub's
