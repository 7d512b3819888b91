"""Issue 23: a file that is not a GGUF model is a 400 before llama.cpp sees it (it was a 503
that left /health degraded for good). No model is loaded: every file here is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvwarm.errors import NotAModelError
from kvwarm.models_dir import check_gguf_magic
from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready

ADMIN = {"Authorization": "Bearer adm"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    models = tmp_path / "models"
    models.mkdir()
    (models / "garbage.gguf").write_bytes(b"this is not a model at all")
    settings = stub_settings(backend="llama_cpp", models=(), models_dir=models, admin_key="adm")
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def test_magic_check(tmp_path: Path) -> None:
    good = tmp_path / "m.gguf"
    good.write_bytes(b"GGUF\x03\x00\x00\x00")
    check_gguf_magic(good)
    with pytest.raises(NotAModelError):
        check_gguf_magic("/etc/passwd")


def test_etc_passwd_by_path_is_400_and_health_stays_ok(client: TestClient) -> None:
    response = client.post("/admin/models/load", json={"path": "/etc/passwd"}, headers=ADMIN)
    assert response.status_code == 400, response.json()
    assert response.json()["error"]["code"] == "not_a_model"
    assert client.get("/health").status_code == 200


def test_garbage_gguf_in_models_dir_is_400_and_health_stays_ok(client: TestClient) -> None:
    by_name = client.post("/admin/models/load", json={"name": "garbage"}, headers=ADMIN)
    assert by_name.status_code == 400, by_name.json()
    used = client.post("/v1/completions", json={"model": "garbage", "prompt": "x"})
    assert used.status_code == 400 and used.json()["error"]["code"] == "not_a_model"
    assert client.get("/health").status_code == 200
