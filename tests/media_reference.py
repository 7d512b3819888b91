"""The reference for images in prompts: llama-server (built from the same pinned llama.cpp by
``bench/peer.py``) with ``--mmproj``, on the tiny projector ``tests/tinymodels.py`` writes,
answers a chat about a picture; kvwarm must answer it the same, greedily
(``tests/engine/test_media_model.py``). CI has no llama-server, so its replies are recorded once
into ``tests/fixtures/media_reference.<vector set>.json`` (``tests/references.py``) with the
sha-256 of every input file:

    python tests/media_reference.py        # rewrites the fixture (needs llama-server, Gemma)

The projector and the pictures are written deterministically (seeded), so the test rebuilds
the very files the fixture names and fails, naming the file, if one ever differs.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from tests import references

ROOT = Path(__file__).parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "media_reference.json"
GEMMA = ROOT / ".venv" / "models" / "gemma-3-270m-q4_k_m.gguf"
#: (case, model width); the model file is found by ``model_path``.
CASES = (("smollm2", 576), ("gemma", 640))
#: The chat template each case renders with (None: the GGUF's own). This Gemma 3 270M GGUF has
#: none, and the chatml fallback's markup is text to Gemma's tokenizer, which kvwarm (it
#: tokenizes message content apart from markup) and llama-server (the whole render at once)
#: split differently; Gemma's own turn markup is special tokens, so both tokenize it alike.
TEMPLATES = {"smollm2": None, "gemma": ROOT / "tests" / "fixtures" / "gemma_turns.jinja"}
PICTURES = (1, 2)
MAX_TOKENS = 12
QUESTION = "What is in this picture?"
SYSTEM = "You describe pictures in one short sentence."


def model_path(case: str) -> Path:
    if case == "gemma":
        return Path(os.environ.get("KVWARM_GEMMA") or GEMMA)
    from kvwarm.embedded import default_model_path

    return default_model_path()


def picture(seed: int) -> bytes:
    """A seeded 64x64 random RGB PNG (the same bytes for the same seed)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


AUDIO_CASE = "smollm2-audio"
CLIPS = (1, 2)
AUDIO_QUESTION = "What do you hear?"


def clip(seed: int) -> bytes:
    """A seeded one-second 16 kHz mono 16-bit WAV (a chord of three seeded tones)."""
    import wave

    rng = np.random.default_rng(seed)
    t = np.arange(16000) / 16000.0
    tones = sum(np.sin(2 * np.pi * f * t) for f in rng.uniform(200, 2000, 3))
    pcm = (tones / 3 * 20000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def audio_messages(wav: bytes) -> list[dict[str, object]]:
    """The audio chat, OpenAI-shaped: a system message, then a question and the clip."""
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": AUDIO_QUESTION},
                {
                    "type": "input_audio",
                    "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
                },
            ],
        },
    ]


def messages(png: bytes) -> list[dict[str, object]]:
    """The chat, OpenAI-shaped: a system message, then a question and the picture."""
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": uri}},
            ],
        },
    ]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record() -> dict[str, object]:
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    from tests.tinymodels import write_tiny_audio_projector, write_tiny_projector

    from multiturn import free_port, post, wait_ready
    from peer import llama_server

    out: dict[str, object] = {"max_tokens": MAX_TOKENS, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case, width in CASES:
            model = model_path(case)
            proj = write_tiny_projector(Path(tmp) / f"mmproj-{case}.gguf", width)
            port = free_port()
            cmd = [
                str(llama_server()), "--host", "127.0.0.1", "--port", str(port), "-m",
                str(model), "--mmproj", str(proj), "-c", "1024", "-np", "1", "-t", "1",
                "-tb", "1", "-fa", "on", "--jinja", "--no-webui", "--no-warmup",
            ]  # fmt: skip
            template = TEMPLATES[case]
            if template is not None:
                cmd += ["--chat-template-file", str(template)]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_ready(f"http://127.0.0.1:{port}/health", proc)
                replies = {}
                for seed in PICTURES:
                    png = picture(seed)
                    body = {
                        "messages": messages(png),
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "cache_prompt": False,
                    }
                    got = post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
                    choice = got["choices"][0]  # type: ignore[index]
                    replies[str(seed)] = {
                        "png_sha256": sha256(png),
                        "text": choice["message"]["content"],
                        "prompt_tokens": got["usage"]["prompt_tokens"],  # type: ignore[index]
                    }
            finally:
                proc.terminate()
                proc.wait(60)
            out["cases"][case] = {  # type: ignore[index]
                "model": model.name,
                "model_sha256": sha256(model.read_bytes()),
                "mmproj_sha256": sha256(proj.read_bytes()),
                "replies": replies,
            }
        out["cases"][AUDIO_CASE] = _record_audio(Path(tmp), write_tiny_audio_projector)  # type: ignore[index]
    return out


def _record_audio(tmp: Path, write: object) -> dict[str, object]:
    """SmolLM2 with the audio projector: a clip is one 750-position span, decoded in one
    pass on both servers (batch and ubatch 1024)."""
    from multiturn import free_port, post, wait_ready
    from peer import llama_server

    model = model_path("smollm2")
    proj = write(tmp / "mmproj-audio.gguf", 576)  # type: ignore[operator]
    port = free_port()
    cmd = [
        str(llama_server()), "--host", "127.0.0.1", "--port", str(port), "-m", str(model),
        "--mmproj", str(proj), "-c", "2048", "-b", "1024", "-ub", "1024", "-np", "1",
        "-t", "1", "-tb", "1", "-fa", "on", "--jinja", "--no-webui", "--no-warmup",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    replies = {}
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc)
        for seed in CLIPS:
            wav = clip(seed)
            body = {
                "messages": audio_messages(wav),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "cache_prompt": False,
            }
            got = post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
            replies[str(seed)] = {
                "wav_sha256": sha256(wav),
                "text": got["choices"][0]["message"]["content"],  # type: ignore[index]
                "prompt_tokens": got["usage"]["prompt_tokens"],  # type: ignore[index]
            }
    finally:
        proc.terminate()
        proc.wait(60)
    return {
        "model": model.name,
        "model_sha256": sha256(model.read_bytes()),
        "mmproj_sha256": sha256(proj.read_bytes()),
        "replies": replies,
    }


if __name__ == "__main__":
    result = record()
    references.fixture(FIXTURE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2))
