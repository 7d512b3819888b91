"""An unload whose worker does not stop in time must not free the context under it.

Found by review: ``Model.unload`` waits for the worker at most ``timeout_s`` (and
``Engine.close(timeout_s)`` passes its own), then closed the context, the adapters and the
model whatever the worker was doing. A worker inside a tick reads llama.cpp's logits through
numpy arrays (prompt logprobs, greedy argmax, logprobs); ``LlamaContext.close`` cannot release
a view numpy has exported, so ``llama_free`` freed the buffer under it: the worker then read
freed memory (garbage logprobs, or a segfault once the pages are unmapped). Now the worker
frees the native state itself when it ends.

The child holds the worker inside its first prompt-logprob computation (a numpy array over the
logits in hand) while the main thread unloads with ``timeout_s=0``; it records whether the
context was freed before the worker finished reading. A child process, so that a read of
unmapped memory fails one test and not the run.
"""

from __future__ import annotations

import pytest
from tests.childkit import ROOT, run_child

pytestmark = [pytest.mark.model, pytest.mark.slow]

CHILD = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
import kvwarm.backends.llama.context as context_mod
import kvwarm.engine.worker.tick as tick_mod
from kvwarm import Engine, EngineConfig
from kvwarm.errors import KvwarmError

reading = threading.Event()   # the worker holds an array over the logits
unloaded = threading.Event()  # Model.unload has returned
done_reading = threading.Event()
freed_while_reading = []

real_logprob = tick_mod.token_logprob

def held_logprob(model, logits, token, top_n):
    if not reading.is_set():
        reading.set()
        unloaded.wait(60)  # a bound, not a synchronisation: the main thread sets it
        try:
            return real_logprob(model, logits, token, top_n)
        finally:
            done_reading.set()
    return real_logprob(model, logits, token, top_n)

tick_mod.token_logprob = held_logprob

real_free = context_mod.LlamaContext._free

def recorded_free(self):
    if reading.is_set() and not done_reading.is_set():
        freed_while_reading.append(True)
    real_free(self)

context_mod.LlamaContext._free = recorded_free

engine = Engine(EngineConfig())
model = engine.load_model(None, model_id="m", n_ctx=256, n_batch=32)
stream = model.submit("The cat sat on the mat and looked at the door.", max_tokens=2,
                      prompt_logprobs=1)
assert reading.wait(120), "the worker never computed a prompt logprob"
model.unload(timeout_s=0)
unloaded.set()
try:
    stream.result()
except KvwarmError:
    pass
assert model._worker._closed.wait(120), "the worker did not end"
print("FREED_WHILE_READING", bool(freed_while_reading), flush=True)
print("CONTEXT_FREED", model._ctx.lifetime.freed, flush=True)
engine.close()
"""


def test_unload_with_a_busy_worker_frees_the_context_after_it() -> None:
    done, lines = run_child(CHILD, str(ROOT / "src"), prefixes=("FREED", "CONTEXT"))
    assert done.returncode == 0, f"child died: rc={done.returncode}, {lines}, {done.stderr[-2000:]}"
    assert "FREED_WHILE_READING False" in lines, lines
    assert "CONTEXT_FREED True" in lines, lines  # freed all the same, once the worker ended
