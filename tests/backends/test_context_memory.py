"""A context's buffer sizes, read from the lines llama.cpp logs while creating it (no call
returns them): no model needed, the lines are the pinned llama.cpp's own."""

from __future__ import annotations

from kvwarm.backends.base import ContextMemory
from kvwarm.backends.llama.context import buffer_sizes

MIB = 1 << 20

LINES = [  # SmolLM2-135M, n_ctx 1024, 2 sequences (verbatim from the pinned llama.cpp)
    "llama_context:        CPU  output buffer size =     0.38 MiB\n",
    "llama_kv_cache:        CPU KV buffer size =    22.50 MiB\n",
    "llama_kv_cache: size =   22.50 MiB (   512 cells,  30 layers,  2/2 seqs), "
    "K (f16):   11.25 MiB, V (f16):   11.25 MiB\n",
    "llama_context: backend_ptrs.size() = 1\n",
    "sched_reserve:        CPU compute buffer size =    98.25 MiB\n",
]


def test_kv_and_other_buffers_are_summed_from_the_log() -> None:
    memory = buffer_sizes(LINES)
    assert memory.kv_bytes == round(22.5 * MIB)  # the summary line is not counted twice
    assert memory.other_bytes == round(0.38 * MIB) + round(98.25 * MIB)
    assert memory.total_bytes == memory.kv_bytes + memory.other_bytes


def test_recurrent_state_and_device_buffers_count_as_kv() -> None:
    lines = [
        "llama_memory_recurrent:        CPU RS buffer size =     1.50 MiB\n",
        "llama_kv_cache:      CUDA0 KV buffer size =    64.00 MiB\n",
    ]
    assert buffer_sizes(lines) == ContextMemory(round(65.5 * MIB), 0)
    assert buffer_sizes([]) == ContextMemory(0, 0)
