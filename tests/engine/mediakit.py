"""Images for media tests: small PNGs written with Pillow, and one pixel changed."""

from __future__ import annotations

import io

import numpy as np


def png(seed: int = 1, size: tuple[int, int] = (64, 64), *, poke: bool = False) -> bytes:
    """A seeded random RGB PNG; ``poke``: the same picture with its first pixel changed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    if poke:
        pixels[0, 0, 0] ^= 1
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_chat(
    picture: bytes, question: str, *, system: str = "You describe pictures."
) -> list[dict[str, object]]:
    """A one-turn chat whose user message shows ``picture`` and asks ``question``."""
    return [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look at this: "},
                {"type": "image", "image": picture},
                {"type": "text", "text": question},
            ],
        },
    ]


def poke(data: bytes) -> bytes:
    """The PNG ``data`` with its first pixel's red value changed by one."""
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    r, g, b = img.getpixel((0, 0))  # type: ignore[misc]
    img.putpixel((0, 0), (r ^ 1, g, b))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()
