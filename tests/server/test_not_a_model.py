"""Issue 23: a file that is not a GGUF model is a 400 before llama.cpp sees it (it was a 503
that left /health degraded for good). So is a GGUF whose header is broken, cut short, or that
llama.cpp refuses to load (an unknown architecture, data past the file's end): the caller's
400 ``invalid_model_file`` naming the file and why, never a 503 ``model_load_failed``."""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
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


def test_a_models_dir_file_swapped_for_a_fifo_is_refused_not_waited_on(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The magic check ran on the event loop, under the registry's lock, and opened the file
    as a blocking open: a models_dir file swapped for a FIFO between its ``is_file`` check and
    that open (docs/server.md: swaps after the check are what models_dir is guarded against)
    had ``open`` wait for a writer for ever, and with it every request of the server (found
    by review). The swap is made certain here by having ``is_file`` see the regular file it
    replaced. The check now opens without blocking and refuses what is no regular file."""
    target = tmp_path / "models" / "swapped.gguf"
    target.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert "swapped" in {m["id"] for m in client.get("/v1/models").json()["data"]}
    target.unlink()
    os.mkfifo(target)
    is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda self: self == target or is_file(self))
    answers: list[httpx.Response] = []
    body = {"model": "swapped", "prompt": "x", "max_tokens": 1}
    asking = threading.Thread(
        target=lambda: answers.append(client.post("/v1/completions", json=body)), daemon=True
    )
    asking.start()
    asking.join(10)
    hung = asking.is_alive()
    if hung:  # the old code: the open waits for a writer; give it one, so the test ends
        os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
        asking.join(10)
    assert not hung, "the server waited on the FIFO"
    assert answers[0].status_code == 400, answers[0].json()
    assert answers[0].json()["error"]["code"] == "not_a_model"
    assert client.get("/health").status_code == 200


# --- A GGUF magic but no loadable model: the caller's 400 too, never a 503 -----------------


def _patched_arch(data: bytes, arch: bytes, other: bytes) -> bytes:
    """``data`` with its ``general.architecture`` value ``arch`` replaced by ``other`` (same
    length)."""
    key = b"general.architecture"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 8
    assert data[at : at + len(arch)] == arch
    return data[:at] + other + data[at + len(arch) :]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A complete tiny model's bytes (Mamba, a few hundred KB, written by llama.cpp)."""
    from tests.tinymodels import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m.gguf", "mamba").read_bytes()


#: name: (the file's bytes from a good model's, what the 400's message says of it)
BROKEN: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    # Refused in Python before llama.cpp opens the file (gguf_meta's walk).
    "cut-header": (lambda data: data[:40], "header is malformed or cut short"),
    "huge-kv-count": (
        lambda data: data[:16] + struct.pack("<Q", 1 << 40) + data[24:],
        "header is malformed or cut short",
    ),
    "version-1": (
        lambda data: data[:4] + struct.pack("<I", 1) + data[8:],
        "GGUF version 1 is not supported",
    ),
    # Refused by llama.cpp, its reason reported (model_file.refusal).
    "cut-data": (lambda data: data[: len(data) - 4096], "not within the file bounds"),
    "unknown-arch": (
        lambda data: _patched_arch(data, b"mamba", b"mambz"),
        "unknown model architecture: 'mambz'",
    ),
}


@pytest.fixture
def broken_dir(tmp_path: Path, tiny_gguf: bytes) -> Path:
    models = tmp_path / "models"
    models.mkdir()
    for name, (edit, _) in BROKEN.items():
        (models / f"{name}.gguf").write_bytes(edit(tiny_gguf))
    return models


@pytest.fixture
def broken_client(broken_dir: Path) -> Iterator[TestClient]:
    settings = stub_settings(
        backend="llama_cpp", models=(), models_dir=broken_dir, admin_key="adm", n_parallel=1
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


@pytest.mark.model
@pytest.mark.parametrize("name", list(BROKEN))
def test_admin_load_of_a_broken_gguf_is_400_naming_file_and_reason(
    broken_client: TestClient, broken_dir: Path, name: str
) -> None:
    """Issue: a good magic with a broken header (or anything else llama.cpp refuses) loaded
    through the admin API was a 503 model_load_failed, blaming the server for the file."""
    path = broken_dir / f"{name}.gguf"
    response = broken_client.post(
        "/admin/models/load", json={"path": str(path), "id": "x"}, headers=ADMIN
    )
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["code"] == "invalid_model_file"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "path"
    assert str(path) in error["message"] and BROKEN[name][1] in error["message"], error
    # Forgotten (the id is free for the right file) and the server's health is unchanged.
    assert broken_client.get("/v1/models/x").status_code == 404
    assert broken_client.get("/health").json()["status"] == "ok"


@pytest.mark.model
def test_request_naming_a_broken_models_dir_file_is_400_and_retried_once_fixed(
    broken_client: TestClient, broken_dir: Path, tiny_gguf: bytes
) -> None:
    by_name = broken_client.post("/admin/models/load", json={"name": "unknown-arch"}, headers=ADMIN)
    assert by_name.status_code == 400, by_name.json()
    assert by_name.json()["error"]["code"] == "invalid_model_file"
    used = broken_client.post("/v1/completions", json={"model": "cut-data", "prompt": "x"})
    assert used.status_code == 400, used.json()
    assert "not within the file bounds" in used.json()["error"]["message"]
    health = broken_client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.json()
    listed = broken_client.get("/v1/models/cut-data").json()
    assert listed["status"] == "available" and "not within the file bounds" in listed["error"]
    # The file is the caller's to fix: once it is, the next request loads it.
    (broken_dir / "cut-data.gguf").write_bytes(tiny_gguf)
    fixed = broken_client.post(
        "/v1/completions", json={"model": "cut-data", "prompt": "x", "max_tokens": 2}
    )
    assert fixed.status_code == 200, fixed.json()
