"""``engine.cancel.Cancellation``: each callback once, on the cancelling thread; one registered
late runs at once; one taken back never runs."""

from __future__ import annotations

import threading

import pytest

from kvwarm.engine.cancel import Cancellation, check_cancel
from kvwarm.errors import InvalidRequestError


def test_callbacks_run_once_and_forgotten_ones_never() -> None:
    cancel = Cancellation()
    ran: list[str] = []
    cancel.on_cancel(lambda: ran.append("a"))
    forget = cancel.on_cancel(lambda: ran.append("b"))
    forget()
    assert not cancel.cancelled and ran == []
    done = threading.Thread(target=cancel.cancel)
    done.start()
    done.join(10)
    cancel.cancel()  # a second cancel runs nothing again
    assert cancel.cancelled and ran == ["a"]
    late = cancel.on_cancel(lambda: ran.append("c"))
    late()  # taking back one that ran is harmless
    assert ran == ["a", "c"]


def test_a_callback_may_register_another_without_deadlock() -> None:
    cancel = Cancellation()
    ran: list[str] = []
    cancel.on_cancel(lambda: cancel.on_cancel(lambda: ran.append("inner")))
    cancel.cancel()
    assert ran == ["inner"]


def test_check_cancel() -> None:
    cancel = Cancellation()
    assert check_cancel(cancel) is cancel and check_cancel(None) is None
    with pytest.raises(InvalidRequestError, match="cancel must be a Cancellation"):
        check_cancel(threading.Event())
