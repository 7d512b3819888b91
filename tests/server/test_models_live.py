"""A models directory, an alias and admin unload/reload on a live server running the embedded
model, through the official ``openai`` client."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvwarm.embedded import default_model_path
from kvwarm.settings import Settings

from .conftest import LOW_POLICY, LiveServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant who answers in one short line."},
    {"role": "user", "content": "Name a colour of the sky."},
]


def test_models_dir_alias_lazy_load_and_admin_unload(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copyfile(default_model_path(), models / "smol.gguf")  # a copy: symlinks are refused
    settings = Settings(
        models=(),
        models_dir=models,
        aliases=(("gpt-4o-mini", "smol"),),
        cache_dir=None,
        n_ctx=512,
        n_batch=64,
        n_parallel=1,
        n_threads=2,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
        admin_key="adm",
    )
    server = LiveServer(settings).start()
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=600)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"smol", "gpt-4o-mini"}
        assert getattr(listed["smol"], "status") == "available"  # noqa: B009  (an extra field)

        first = client.chat.completions.create(
            model="gpt-4o-mini",
            messages=MESSAGES,
            max_tokens=4,
            temperature=0,  # type: ignore[arg-type]
        )
        assert first.model == "smol" and first.choices[0].message.content
        status = {m.id: getattr(m, "status") for m in client.models.list().data}  # noqa: B009
        assert status["smol"] == "ready"

        admin = {"Authorization": "Bearer adm"}
        unloaded = httpx.post(
            server.base_url + "/admin/models/unload", json={"model": "smol"}, headers=admin
        )
        assert unloaded.status_code == 200 and unloaded.json()["status"] == "available"

        again = client.chat.completions.create(
            model="smol",
            messages=MESSAGES,
            max_tokens=4,
            temperature=0,  # type: ignore[arg-type]
        )
        assert again.choices[0].message.content == first.choices[0].message.content
        # Reloaded on use; the rows saved before the unload serve the prompt again.
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert (again.usage.prompt_tokens_details.cached_tokens or 0) > 0
    finally:
        server.stop()
