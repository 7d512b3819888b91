"""Models over HTTP on the stub backend: partly failed servers, a models directory loaded on first
use, aliases, the idle unload and the admin load/unload endpoints behind their keys."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvwarm.engine.engine import Engine
from kvwarm.engine.model import Model
from kvwarm.errors import ConfigError
from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

from .conftest import stub_settings, wait_ready

BODY = {"prompt": "Hello there", "max_tokens": 2, "temperature": 0}


def _code(response: httpx.Response) -> tuple[int, str | None]:
    return response.status_code, response.json().get("error", {}).get("code")


def _states(client: TestClient) -> dict[str, str]:
    return {m["id"]: m["status"] for m in client.get("/v1/models").json()["data"]}


def test_a_failed_model_is_503_with_its_reason_and_the_others_are_served() -> None:
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-a", id="a"),
            ModelSpec(path="/nonexistent/gone.gguf", id="gone", backend="llama_cpp"),
        )
    )
    fatal: list[str] = []
    with TestClient(create_app(settings, on_fatal=fatal.append)) as client:
        wait_ready(client.get)
        health = client.get("/health").json()
        assert health["status"] == "degraded" and health["models"]["a"] == "ready"
        assert "model file not found" in health["errors"]["gone"]
        failed = client.post("/v1/completions", json={**BODY, "model": "gone"})
        assert _code(failed) == (503, "model_load_failed")
        assert "/nonexistent/gone.gguf" in failed.json()["error"]["message"]
        assert client.post("/v1/completions", json={**BODY, "model": "a"}).status_code == 200
    assert fatal == []


def test_a_server_whose_every_model_failed_reports_why() -> None:
    settings = stub_settings(
        models=(ModelSpec(path="/nonexistent/gone.gguf", id="gone", backend="llama_cpp"),)
    )
    fatal: list[str] = []
    with TestClient(create_app(settings, on_fatal=fatal.append)) as client:
        with pytest.raises(AssertionError, match="failed to load"):
            wait_ready(client.get)
        assert _code(client.get("/health")) == (503, "model_load_failed")
    assert len(fatal) == 1 and "gone: ModelNotFoundError: model file not found" in fatal[0]


@pytest.fixture
def models(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    for name in ("alpha.gguf", "beta.gguf"):
        (d / name).write_bytes(b"GGUF stub weights " + name.encode())
    outside = tmp_path / "secret.gguf"
    outside.write_bytes(b"GGUF not in the directory")
    os.symlink(outside, d / "linked.gguf")
    return d


@pytest.fixture
def dir_client(models: Path) -> Iterator[TestClient]:
    settings = stub_settings(
        models=(), models_dir=models, aliases=(("gpt-4o-mini", "alpha"),), admin_key="adm"
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        yield client


ADMIN = {"Authorization": "Bearer adm"}


def test_models_dir_is_listed_and_loaded_on_first_use(dir_client: TestClient) -> None:
    assert _states(dir_client) == {
        "alpha": "available",
        "beta": "available",
        "gpt-4o-mini": "available",
    }
    listing = {m["id"]: m for m in dir_client.get("/v1/models").json()["data"]}
    assert listing["gpt-4o-mini"]["alias_of"] == "alpha"
    one = dir_client.get("/v1/models/gpt-4o-mini").json()
    assert (one["id"], one["alias_of"], one["status"]) == ("gpt-4o-mini", "alpha", "available")
    assert dir_client.get("/v1/models/beta").json()["source"] == "models_dir"
    answer = dir_client.post("/v1/completions", json={**BODY, "model": "beta"})
    assert answer.status_code == 200 and answer.json()["model"] == "beta"
    assert _states(dir_client)["beta"] == "ready"
    via_alias = dir_client.post("/v1/chat/completions", json={
        "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
    })  # fmt: skip
    assert via_alias.status_code == 200 and via_alias.json()["model"] == "alpha"
    assert _states(dir_client)["alpha"] == "ready"
    # A symlink (to a file outside the directory) is neither listed nor loadable by name.
    assert _code(dir_client.post("/v1/completions", json={**BODY, "model": "linked"}))[0] == 404
    refused = dir_client.post("/admin/models/load", json={"name": "linked"}, headers=ADMIN)
    assert _code(refused)[0] == 404
    assert "linked" not in _states(dir_client)


def test_a_projector_or_part_swapped_for_a_symlink_after_the_scan_is_refused(
    tmp_path: Path,
) -> None:
    # Found by review: the model file was checked at load time, but its projector and the
    # other parts of a split model (opened by name beside it) were followed through a link.
    d = tmp_path / "models"
    d.mkdir()
    outside = tmp_path / "secret.gguf"
    outside.write_bytes(b"GGUF not in the directory")
    for name in (
        "eye.gguf",
        "mmproj-eye.gguf",
        "big-00001-of-00002.gguf",
        "big-00002-of-00002.gguf",
    ):
        (d / name).write_bytes(b"GGUF stub")
    with TestClient(create_app(stub_settings(models=(), models_dir=d))) as client:
        wait_ready(client.get)
        assert _states(client) == {"big": "available", "eye": "available"}
        for name in ("mmproj-eye.gguf", "big-00002-of-00002.gguf"):
            (d / name).unlink()
            os.symlink(outside, d / name)
        for model in ("eye", "big"):
            refused = client.post("/v1/completions", json={**BODY, "model": model})
            assert _code(refused) == (503, "model_load_failed"), refused.json()
            assert "symlinks are refused" in refused.json()["error"]["message"]


def test_a_file_swapped_for_a_symlink_after_the_check_is_not_what_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: the model, its parts and its projector were checked, then opened by
    # name (by llama.cpp) later; a symlink swapped in between was followed out of the
    # directory. Now each is opened once, without following links, and read through that.
    d = tmp_path / "models"
    d.mkdir()
    outside = tmp_path / "secret.gguf"
    outside.write_bytes(b"GGUF not in the directory")
    for name in ("eye.gguf", "mmproj-eye.gguf"):
        (d / name).write_bytes(b"GGUF stub " + name.encode())
    real_load = Engine.load_model
    read: dict[str, bytes] = {}

    def swap_then_load(self: Engine, path: object = None, **kw: Any) -> Model:
        for name in ("eye.gguf", "mmproj-eye.gguf"):  # after the check, before the open
            (d / name).unlink()
            os.symlink(outside, d / name)
        read["model"] = Path(str(path)).read_bytes()
        read["projector"] = Path(str(kw["config"].mmproj)).read_bytes()
        return real_load(self, path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "load_model", swap_then_load)
    with TestClient(create_app(stub_settings(models=(), models_dir=d))) as client:
        wait_ready(client.get)
        assert client.post("/v1/completions", json={**BODY, "model": "eye"}).status_code == 200
        shown = client.get("/v1/models/eye").json()
    assert read == {"model": b"GGUF stub eye.gguf", "projector": b"GGUF stub mmproj-eye.gguf"}
    # Shown by their names in the directory, not the paths they were read through.
    assert shown["meta"]["path"] == str(d / "eye.gguf")
    assert shown["meta"]["mmproj"] == str(d / "mmproj-eye.gguf")


def test_a_load_by_path_never_takes_the_name_of_an_alias_or_an_adapter(tmp_path: Path) -> None:
    # Found by review: a path loaded under the id "gpt-4o-mini" (an alias of "a") or "sql" (a
    # LoRA adapter) took every request naming it, and /v1/models listed the name twice.
    weights = tmp_path / "other.gguf"
    weights.write_bytes(b"GGUF other")
    adapter = tmp_path / "sql.gguf"
    adapter.write_bytes(b"stub adapter: sql")
    settings = stub_settings(
        aliases=(("gpt-4o-mini", "a"),), lora=(("sql", str(adapter)),), admin_key="adm"
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        for name in ("gpt-4o-mini", "sql"):
            body = {"path": str(weights), "id": name}
            refused = client.post("/admin/models/load", json=body, headers=ADMIN)
            assert _code(refused) == (409, "model_exists"), refused.json()
            answer = client.post("/v1/completions", json={**BODY, "model": name})
            assert answer.status_code == 200 and answer.json()["model"] in ("a", "sql")
        names = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert sorted(names) == ["a", "b", "gpt-4o-mini", "sql"]


def test_a_models_dir_file_never_takes_the_name_of_an_alias_or_an_adapter(
    tmp_path: Path,
) -> None:
    # Found by review: "gpt-4o-mini.gguf" or "sql.gguf" dropped into models_dir became a model
    # of that id, which took every request naming the alias or the adapter.
    d = tmp_path / "models"
    d.mkdir()
    adapter = tmp_path / "sql.gguf"
    adapter.write_bytes(b"stub adapter: sql")
    settings = stub_settings(
        models=(ModelSpec(path="stub-a", id="a"),),
        models_dir=d,
        aliases=(("gpt-4o-mini", "a"),),
        lora=(("sql", str(adapter)),),
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        for name in ("gpt-4o-mini.gguf", "sql.gguf", "c.gguf"):
            (d / name).write_bytes(b"GGUF stub")
        names = sorted(m["id"] for m in client.get("/v1/models").json()["data"])
        assert names == ["a", "c", "gpt-4o-mini", "sql"]
        for name in ("gpt-4o-mini", "sql"):
            answer = client.post("/v1/completions", json={**BODY, "model": name})
            assert answer.status_code == 200 and answer.json()["model"] in ("a", "sql")
        assert _states(client)["a"] == "ready"


def test_new_files_appear_without_a_restart(dir_client: TestClient, models: Path) -> None:
    (models / "gamma.gguf").write_bytes(b"GGUF new")
    assert _states(dir_client)["gamma"] == "available"
    assert dir_client.post("/v1/completions", json={**BODY, "model": "gamma"}).status_code == 200


def test_admin_load_and_unload(dir_client: TestClient, models: Path, tmp_path: Path) -> None:
    assert _code(dir_client.post("/admin/models/load", json={"name": "alpha"})) == (
        401,
        "invalid_admin_key",
    )
    loaded = dir_client.post("/admin/models/load", json={"name": "alpha"}, headers=ADMIN)
    assert loaded.status_code == 200 and loaded.json()["status"] == "ready"
    unloaded = dir_client.post("/admin/models/unload", json={"model": "alpha"}, headers=ADMIN)
    assert unloaded.status_code == 200 and unloaded.json()["status"] == "available"
    assert dir_client.post("/v1/completions", json={**BODY, "model": "alpha"}).status_code == 200
    # A path anywhere (an admin's choice), under an id of its own.
    other = tmp_path / "elsewhere.gguf"
    other.write_bytes(b"GGUF")
    by_path = dir_client.post(
        "/admin/models/load", json={"path": str(other), "id": "else"}, headers=ADMIN
    )
    assert by_path.status_code == 200 and by_path.json()["id"] == "else"
    clash = dir_client.post(
        "/admin/models/load", json={"path": str(models / "beta.gguf"), "id": "else"}, headers=ADMIN
    )
    assert _code(clash) == (409, "model_exists")
    assert (
        _code(dir_client.post("/admin/models/unload", json={"model": "nope"}, headers=ADMIN))[0]
        == 404
    )
    both = dir_client.post("/admin/models/load", json={"name": "a", "path": "/x"}, headers=ADMIN)
    assert _code(both)[0] == 400
    # An id is for a path: a name load keeps its own id rather than silently ignore it.
    renamed = dir_client.post("/admin/models/load", json={"name": "beta", "id": "b"}, headers=ADMIN)
    assert _code(renamed)[0] == 400 and "b" not in _states(dir_client)
    # State-changing: a foreign page may not drive it, key or not.
    foreign = {**ADMIN, "Origin": "http://evil.example"}
    assert _code(
        dir_client.post("/admin/models/unload", json={"model": "beta"}, headers=foreign)
    ) == (
        403,
        "origin_not_allowed",
    )


@pytest.mark.model  # llama.cpp reads the broken file's header
def test_a_path_that_fails_to_load_is_forgotten(tmp_path: Path) -> None:
    # A failed load by path kept its entry: /health stayed degraded and the id stayed taken,
    # so loading the right file under it was a 409 until a restart.
    settings = stub_settings(
        backend="llama_cpp",  # what a path loads with; it fails before any weights are read
        models=(ModelSpec(path="stub-a", id="a", backend="stub"),),
        admin_key="adm",
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        for typo in ("/nonexistent/x.gguf", str(tmp_path / "also-missing.gguf")):
            missing = client.post(
                "/admin/models/load", json={"path": typo, "id": "x"}, headers=ADMIN
            )
            assert _code(missing) == (404, "model_not_found")  # a typo: nothing to retry
            assert "x" not in _states(client)
        not_a_model = tmp_path / "notes.gguf"
        not_a_model.write_bytes(b"not a GGUF file")
        refused = client.post(
            "/admin/models/load", json={"path": str(not_a_model), "id": "x"}, headers=ADMIN
        )
        assert _code(refused) == (400, "not_a_model")  # refused before llama.cpp reads it
        assert client.get("/health").json()["status"] == "ok"
        broken = tmp_path / "broken.gguf"  # a GGUF's magic over a truncated header
        broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
        for _ in range(2):
            failed = client.post(
                "/admin/models/load", json={"path": str(broken), "id": "x"}, headers=ADMIN
            )
            # The file's fault, not the server's: a 400 (it was a 503 model_load_failed),
            # naming the file and why; and not a 409 the second time.
            assert _code(failed) == (400, "invalid_model_file")
            assert str(broken) in failed.json()["error"]["message"]
            assert "malformed or cut short" in failed.json()["error"]["message"]
            assert "x" not in _states(client)
            assert client.get("/health").json()["status"] == "ok"


def test_loading_by_path_needs_a_configured_key(models: Path) -> None:
    with TestClient(create_app(stub_settings(models=(), models_dir=models))) as client:
        wait_ready(client.get)
        refused = client.post("/admin/models/load", json={"path": str(models / "alpha.gguf")})
        assert _code(refused) == (403, "key_required")
        by_name = client.post("/admin/models/load", json={"name": "alpha"})
        assert by_name.status_code == 200  # like /cache/*: open when no key is configured
    with TestClient(create_app(stub_settings(models=(), models_dir=models, api_key="k"))) as client:
        wait_ready(client.get)
        headers = {"Authorization": "Bearer k"}
        ok = client.post(
            "/admin/models/load", json={"path": str(models / "beta.gguf")}, headers=headers
        )
        assert ok.status_code == 200 and ok.json()["id"] == "beta"


def test_idle_models_are_unloaded_and_reload_on_use(models: Path) -> None:
    settings = stub_settings(models=(), models_dir=models, model_idle_unload_s=0.2)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        assert client.post("/v1/completions", json={**BODY, "model": "alpha"}).status_code == 200
        deadline = time.monotonic() + 30
        while _states(client)["alpha"] != "available":  # bounded wait for the idle timer
            assert time.monotonic() < deadline, "the idle model was never unloaded"
            time.sleep(0.05)
        assert client.post("/v1/completions", json={**BODY, "model": "alpha"}).status_code == 200


def test_cap_on_loaded_models(models: Path) -> None:
    settings = stub_settings(models=(), models_dir=models, max_loaded_models=1)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        assert client.post("/v1/completions", json={**BODY, "model": "alpha"}).status_code == 200
        assert client.post("/v1/completions", json={**BODY, "model": "beta"}).status_code == 200
        states = _states(client)
        assert (states["alpha"], states["beta"]) == ("available", "ready")


def test_an_alias_to_an_unknown_model_stops_the_start() -> None:
    with pytest.raises(ConfigError, match="alias gpt-4o=nope: no model 'nope'"):
        create_app(stub_settings(aliases=(("gpt-4o", "nope"),)))
    with pytest.raises(ConfigError, match="already model ids"):
        create_app(stub_settings(aliases=(("a", "b"),)))


def test_a_load_by_a_path_no_stat_can_answer_is_a_404(tmp_path: Path) -> None:
    # Found by review: is_file raised for a name too long (ENAMETOOLONG), and the load was a
    # 500 internal_error; a NUL byte was already a 404.
    with TestClient(create_app(stub_settings(admin_key="adm"))) as client:
        wait_ready(client.get)
        # "~kvwarm-no-such-user" too: pathlib's expanduser raised RuntimeError for a user
        # with no home (found by the settings property test); it is a name like any other.
        for path in (str(tmp_path / ("a" * 300)), "/tmp/a\x00b", "~kvwarm-no-such-user/m.gguf"):
            refused = client.post("/admin/models/load", json={"path": path}, headers=ADMIN)
            assert _code(refused) == (404, "model_not_found"), refused.json()
            assert refused.json()["error"]["param"] == "path"
        assert client.get("/health").status_code == 200


def test_model_ids_with_slashes_reach_their_own_model_on_every_model_route() -> None:
    """Hugging Face style ids (``org/model``), one a prefix of another's: the path route
    (``/v1/models/{id}``) and the routes naming a model in their body or query act on that
    model and no other (checked by review: none 404s or picks the wrong one)."""
    ids = ("org", "org/model", "org/model/v2")
    settings = stub_settings(
        models=tuple(ModelSpec(path=f"stub-{i}", id=mid) for i, mid in enumerate(ids))
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        for mid in ids:
            assert client.get(f"/v1/models/{mid}").json()["id"] == mid
        assert client.get("/v1/models/org%2Fmodel").json()["id"] == "org/model"
        assert _code(client.get("/v1/models/org/model/"))[0] == 404  # no such id
        body = {"model": "org/model", "prompt": "hello " * 40}
        assert client.post("/cache/prewarm", json=body).json()["model"] == "org/model"
        assert client.get("/lora-adapters", params={"model": "org/model/v2"}).status_code == 200
        unloaded = client.post("/admin/models/unload", json={"model": "org/model"}).json()
        assert unloaded["id"] == "org/model"
        assert _states(client) == {
            "org": "ready",
            "org/model": "available",
            "org/model/v2": "ready",
        }
        body = {"model": "org/model", "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).json()["model"] == "org/model"
        assert _states(client)["org/model"] == "ready"  # loaded again by its request


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "alpha"}, "prompt"),
        ({"model": "alpha", "prompt": "x " * 40, "messages": []}, "prompt"),
        ({"model": "alpha", "prompt": "x " * 40, "shared": True}, "shared"),
    ],
)
def test_a_bad_prewarm_is_refused_before_its_model_loads(
    dir_client: TestClient, body: dict[str, object], param: str
) -> None:
    """Found by review: ``/cache/prewarm`` loaded the model its body named (and kept it
    loaded) before it found the body wanting (neither or both of prompt and messages, a
    tenant target without cache_salt_from_auth), then answered the 400."""
    refused = dir_client.post("/cache/prewarm", json=body, headers=ADMIN)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert _states(dir_client)["alpha"] == "available"  # not loaded
