"""The configuration surface as a whole (found by the settings review): a typo in any source is
an error or at least said, never silently nothing; messages name the setting and what it
takes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvwarm.errors import ConfigError
from kvwarm.settings import load_settings


@pytest.mark.parametrize(
    ("var", "meant"),
    [
        ("KVWARM_N_CTXX", "KVWARM_N_CTX"),
        ("KVWARM_NCTX", "KVWARM_N_CTX"),
        ("KVWARM_N_PARALEL", "KVWARM_N_PARALLEL"),
        ("KVWARM_MODEL_DIR", "KVWARM_MODELS_DIR"),
        ("KVWARM_API_KEYS", "KVWARM_API_KEY"),
        ("kvwarm_cache_dirr", "KVWARM_CACHE_DIR"),
    ],
)
def test_a_misspelled_environment_setting_is_refused(var: str, meant: str) -> None:
    """It was ignored: ``KVWARM_API_KEYS=secret`` served with no key at all."""
    with pytest.raises(ConfigError, match=f"{var} is not a kvwarm setting; did you mean {meant}"):
        load_settings({}, {var: "5"})


def test_another_kvwarm_variable_is_logged_and_the_known_ones_are_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    known = {
        "KVWARM_MODEL": "x.gguf",  # the library's default model, not a setting
        "KVWARM_STUB_DECODE_DELAY_S": "0",
        "KVWARM_TEST_GPU_LAYERS": "99",  # the test suite's
        "KVWARM_GEMMA": "/m.gguf",
        "KVWARM_POLICY_MIN_TOKENS": "64",  # checked with the policy
        "OTHER_TOOL_SETTING": "1",
    }
    with caplog.at_level(logging.WARNING, logger="kvwarm.settings.sources"):
        load_settings({}, known)
        assert not caplog.records
        load_settings({}, {"KVWARM_SOMETHING_ELSE_ENTIRELY": "1"})
    assert [r.getMessage() for r in caplog.records] == [
        "environment variable KVWARM_SOMETHING_ELSE_ENTIRELY is not a kvwarm setting; ignored"
    ]


def test_every_setting_is_still_read_from_its_variable(tmp_path: Path) -> None:
    config = tmp_path / "kvwarm.toml"
    config.write_text("n_parallel = 2\n")
    settings = load_settings({}, {"KVWARM_N_CTX": "2048", "KVWARM_CONFIG": str(config)})
    assert (settings.n_ctx, settings.n_parallel) == (2048, 2)
