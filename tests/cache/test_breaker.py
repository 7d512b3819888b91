"""The remote stores' breaker (``objects.Breaker``) through ``S3Wire``, its clock driven by
hand: after a network fault a dead store is skipped for ``down_for_s``; when that has passed,
one call tries the store while every other still fails at once (found by review: every
caller in flight when the window ended -- a wave of probes, the writer threads, a restore
on the engine's thread -- waited out its own timeout against the same dead store, each
window); a long outage is warned once, and its end said. No network: the faults are raised
by the functions the wire runs."""

from __future__ import annotations

import logging
import threading
import time
import types

import pytest
from botocore.exceptions import EndpointConnectionError

from kvwarm.cache.tiers import objects
from kvwarm.cache.tiers.s3client import S3Wire
from kvwarm.errors import CacheIOError, CacheNetworkError


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    """The breaker's clock (``objects.time.monotonic``), moved by the test."""
    fake = _Clock()
    shim = types.SimpleNamespace(monotonic=fake.monotonic, time=time.time)
    monkeypatch.setattr(objects, "time", shim)
    return fake


class _NoClient:
    """Never called: each call's outcome is the function the wire runs."""


def _wire() -> S3Wire:
    return S3Wire(_NoClient(), label="s3 (test)", down_for_s=5.0)  # type: ignore[arg-type]


def _refused() -> str:
    raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")


def test_after_the_window_one_call_tries_the_store_the_others_fail_at_once(
    clock: _Clock,
) -> None:
    wire = _wire()
    with pytest.raises(CacheNetworkError):
        wire.call("get a", _refused)
    clock.now += 6  # the window has passed
    entered, release = threading.Event(), threading.Event()
    outcome: list[BaseException] = []

    def hangs() -> str:
        entered.set()
        release.wait(30)  # a connect timeout against a store that does not answer
        return _refused()

    def trial() -> None:
        try:
            wire.call("get b", hangs)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=trial)
    t.start()
    try:
        assert entered.wait(30)
        ran: list[int] = []
        with pytest.raises(CacheNetworkError, match="marked down"):
            wire.call("get c", lambda: ran.append(1))
        assert ran == []  # no second caller waits on the same dead store
    finally:
        release.set()
        t.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], CacheNetworkError)
    with pytest.raises(CacheNetworkError, match="marked down"):
        wire.call("get d", lambda: "not run")  # the trial failed: down for another window
    clock.now += 6
    assert wire.call("get e", lambda: "answer") == "answer"  # the trial succeeds...
    assert wire.call("get f", lambda: "answer") == "answer"  # ...and everyone goes again
    assert not wire.is_down()


def test_a_trial_that_never_ends_lets_another_through_a_window_later(clock: _Clock) -> None:
    """A trial whose thread is stuck past the window (a read timeout longer than it) does
    not keep the store shut for good: one more caller tries it a window later."""
    wire = _wire()
    with pytest.raises(CacheNetworkError):
        wire.call("get a", _refused)
    clock.now += 6
    entered, release = threading.Event(), threading.Event()

    def hangs() -> str:
        entered.set()
        release.wait(30)
        return "late"

    t = threading.Thread(target=lambda: wire.call("get b", hangs))
    t.start()
    try:
        assert entered.wait(30)
        with pytest.raises(CacheNetworkError):
            wire.call("get c", lambda: "not run")
        clock.now += 6
        assert wire.call("get d", lambda: "answer") == "answer"
    finally:
        release.set()
        t.join(30)


def test_a_refusal_ends_the_trial_the_store_is_up(clock: _Clock) -> None:
    """A 403 or a missing object is an answer: the store is reachable again."""
    wire = _wire()
    with pytest.raises(CacheNetworkError):
        wire.call("get a", _refused)
    clock.now += 6

    def refuses() -> str:
        raise CacheIOError("403")

    with pytest.raises(CacheIOError):
        wire.call("get b", refuses)
    assert wire.call("get c", lambda: "answer") == "answer"


def test_a_long_outage_is_warned_once_and_its_end_said(
    clock: _Clock, caplog: pytest.LogCaptureFixture
) -> None:
    wire = _wire()
    caplog.set_level(logging.INFO, logger=objects.__name__)
    for _ in range(4):  # a trial every window, each failing: one outage
        with pytest.raises(CacheNetworkError):
            wire.call("get a", _refused)
        clock.now += 6
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "skipping the store" in warnings[0].getMessage()
    assert wire.call("get b", lambda: "answer") == "answer"
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and "answers again" in said[1]
    with pytest.raises(CacheNetworkError):
        wire.call("get c", _refused)  # a new outage: warned again
    assert len([r for r in caplog.records if "skipping the store" in r.getMessage()]) == 2


def test_an_answer_to_a_call_sent_before_the_fault_does_not_end_the_window(
    clock: _Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A store throttling some calls answers others in flight: their answers within the
    window neither reopen the store nor say, then warn again, that it is down."""
    wire = _wire()
    caplog.set_level(logging.INFO, logger=objects.__name__)
    entered, release = threading.Event(), threading.Event()

    def answers_late() -> str:
        entered.set()
        release.wait(30)
        return "answer"

    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(wire.call("get a", answers_late)))
    t.start()
    try:
        assert entered.wait(30)
        with pytest.raises(CacheNetworkError):
            wire.call("get b", _refused)
    finally:
        release.set()
        t.join(30)
    assert got == ["answer"]
    assert wire.is_down()
    with pytest.raises(CacheNetworkError, match="marked down"):
        wire.call("get c", lambda: "not run")
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
