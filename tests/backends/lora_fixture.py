"""A real, tiny LoRA adapter GGUF for a base model, made at test time (no hub download).

The layout follows llama.cpp's loader (``src/llama-adapter.cpp``, ``llama_adapter_lora_init``):

- metadata: ``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``
  (f32) and ``general.architecture`` equal to the base model's;
- for each adapted base tensor ``NAME`` (e.g. ``blk.0.attn_q.weight``) a pair
  ``NAME.lora_a`` / ``NAME.lora_b``; in ggml order (ne0 first) a base weight is
  ``[n_in, n_out]``, ``lora_a`` is ``[n_in, rank]`` and ``lora_b`` is ``[rank, n_out]``, so in
  numpy (row-major, reversed) ``a`` has shape ``(rank, n_in)`` and ``b`` ``(n_out, rank)``;
- llama.cpp adds ``scale * alpha / rank * (B @ A) @ x`` to the base matmul's output.

The shapes are read from the base file with ``gguf.GGUFReader``, so the adapter always fits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import gguf
import numpy as np

#: Projections adapted in each chosen layer.
TARGETS = ("attn_q", "attn_v", "attn_output", "ffn_down")


@functools.lru_cache(maxsize=4)
def _read_base(base_model_path: str) -> tuple[str, dict[str, tuple[int, int]]]:
    # GGUFReader parses every metadata array (the tokenizer's too): seconds per call.
    reader = gguf.GGUFReader(base_model_path)
    field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if field is None:
        raise ValueError(f"{base_model_path}: no general.architecture")
    arch = str(field.contents())
    shapes: dict[str, tuple[int, int]] = {}
    for t in reader.tensors:
        ne = [int(x) for x in t.shape]
        if len(ne) == 2:
            shapes[t.name] = (ne[0], ne[1])  # ggml order: (n_in, n_out)
    return arch, shapes


def make_lora(
    base_model_path: str | Path,
    out_path: str | Path,
    *,
    rank: int = 4,
    seed: int = 0,
    scale_hint: float = 3.0,
    layers: Sequence[int] = (0, 1, 2, 3),
    alpha: float | None = None,
    f16: bool = False,
    q8_0: bool = False,
    misfit: int = 0,
    invocation: Sequence[int] = (),
) -> Path:
    """Write a LoRA adapter GGUF for ``base_model_path`` to ``out_path`` and return it.

    ``scale_hint`` sets the strength: each adapted weight gets a delta of RMS about
    ``scale_hint`` times a typical weight's (for a unit ``scale`` at attach time). ``alpha``
    defaults to ``rank`` (effective multiplier 1). Deterministic for a given ``seed``.
    ``misfit``: widen each ``lora_a`` by that many inputs, so the adapter is one made for a
    model of other dimensions (llama.cpp refuses it: "has incorrect shape"). ``invocation``:
    make it an activated LoRA (aLoRA: ``adapter.alora.invocation_tokens``). ``q8_0``: its
    tensors quantised to Q8_0 (``rank`` a multiple of 32: a row of ``lora_b`` is ``rank``
    long).
    """
    arch, shapes = _read_base(str(base_model_path))
    if arch != "llama":
        raise ValueError(f"unsupported base architecture {arch!r}")
    alpha = float(rank) if alpha is None else float(alpha)
    rng = np.random.default_rng(seed)
    dtype = np.float16 if f16 else np.float32
    out = Path(out_path)
    writer = gguf.GGUFWriter(str(out), arch=arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    if invocation:
        writer.add_key_value(
            "adapter.alora.invocation_tokens",
            list(invocation),
            gguf.GGUFValueType.ARRAY,
            sub_type=gguf.GGUFValueType.UINT32,
        )
    n = 0
    for layer in layers:
        for target in TARGETS:
            name = f"blk.{layer}.{target}.weight"
            if name not in shapes:
                raise ValueError(f"base model has no tensor {name!r}")
            n_in, n_out = shapes[name]
            # Entries of B @ A have variance rank * var(a) * var(b) = (scale_hint / sqrt(n_in))^2:
            # the size of a typical weight that keeps activations at unit scale.
            std = math.sqrt(scale_hint / math.sqrt(n_in) / math.sqrt(rank))
            a = rng.normal(0.0, std, size=(rank, n_in + misfit)).astype(dtype)
            b = rng.normal(0.0, std, size=(n_out, rank)).astype(dtype)
            for part, values in (("lora_a", a), ("lora_b", b)):
                if q8_0:
                    q = gguf.GGMLQuantizationType.Q8_0
                    packed = gguf.quants.quantize(values.astype(np.float32), q)
                    writer.add_tensor(f"{name}.{part}", packed, raw_dtype=q)
                else:
                    writer.add_tensor(f"{name}.{part}", values)
            n += 1
    if n == 0:
        raise ValueError("no layers to adapt")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def make_odd_lora(
    base_model_path: str | Path,
    out_path: str | Path,
    *,
    dtype: type[np.generic] = np.float32,
    outer: int = 1,
    which: str = "lora_a",
    keys: Mapping[str, tuple[object, gguf.GGUFValueType]] = {},
    rank: int = 4,
) -> Path:
    """An adapter llama.cpp's loader takes (names, first two dimensions right) that no forward
    pass can run: one pair for ``blk.0.attn_q.weight`` of numpy type ``dtype`` (an integer
    type, f64), or with ``which`` (``lora_a`` or ``lora_b``) given a third dimension of
    ``outer``. Under llama.cpp alone the first decode under it aborts or crashes. ``keys``:
    metadata written as (value, GGUF type) instead of the adapter's own (``general.type``,
    ``adapter.type``, ``adapter.lora.alpha``), an array's elements as float32. ``rank``: 0
    makes both tensors empty (no elements), which llama.cpp loads too where a pair beside
    them has elements (one of rank 4 for ``blk.1.attn_q.weight`` is added)."""
    arch, shapes = _read_base(str(base_model_path))
    name = "blk.0.attn_q.weight"
    n_in, n_out = shapes[name]
    a = np.ones((rank, n_in), dtype=dtype)
    b = np.ones((n_out, rank), dtype=dtype)
    if outer > 1:
        if which == "lora_a":
            a = np.ones((outer, rank, n_in), dtype=dtype)
        else:
            b = np.ones((outer, n_out, rank), dtype=dtype)
    out = Path(out_path)
    writer = gguf.GGUFWriter(str(out), arch=arch)
    own: dict[str, tuple[object, gguf.GGUFValueType]] = {
        gguf.Keys.General.TYPE: (gguf.GGUFType.ADAPTER, gguf.GGUFValueType.STRING),
        gguf.Keys.Adapter.TYPE: ("lora", gguf.GGUFValueType.STRING),
        gguf.Keys.Adapter.LORA_ALPHA: (float(max(rank, 1)), gguf.GGUFValueType.FLOAT32),
    }
    for key, (value, vtype) in {**own, **keys}.items():
        sub = gguf.GGUFValueType.FLOAT32 if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_tensor(f"{name}.lora_a", a)
    writer.add_tensor(f"{name}.lora_b", b)
    if rank == 0:  # llama.cpp refuses an adapter of no bytes at all (an empty buffer)
        writer.add_tensor("blk.1.attn_q.weight.lora_a", np.ones((4, n_in), dtype=dtype))
        writer.add_tensor("blk.1.attn_q.weight.lora_b", np.ones((n_out, 4), dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def make_embd_lora(
    base_model_path: str | Path, out_path: str | Path, *, rank_a: int = 4, rank_b: int = 4
) -> Path:
    """An adapter of one pair for ``token_embd.weight``, laid out as llama.cpp reads it there
    (``llm_graph_context::build_inp_embd``: A and B flipped, B not transposed): ``lora_a``
    ``[rank_a, n_vocab]``, ``lora_b`` ``[rank_b, n_embd]`` in ggml order. llama.cpp's loader
    checks only the ``n_vocab`` and ``n_embd`` sides: ranks that differ load and abort the
    first forward pass; so does any such pair on a model whose output is ``token_embd``
    (tied), whose product takes the pair as a plain one."""
    arch, shapes = _read_base(str(base_model_path))
    n_embd, n_vocab = shapes["token_embd.weight"]
    writer = gguf.GGUFWriter(str(out_path), arch=arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank_a))
    writer.add_tensor("token_embd.weight.lora_a", np.full((n_vocab, rank_a), 0.01, np.float32))
    writer.add_tensor("token_embd.weight.lora_b", np.full((n_embd, rank_b), 0.01, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)
