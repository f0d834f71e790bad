"""The loop's start-up helper: the first batch fetched in the background (the frozen XLA path's progress read from
meta.json: ``test_xla_resume.py``)."""

from __future__ import annotations

import threading

import pytest

from raytrn.data.feed import StartEarly


def test_first_item_is_fetched_before_it_is_asked_for() -> None:
    started = threading.Event()

    def items():
        started.set()
        yield from range(5)

    it = StartEarly(items)
    assert started.wait(timeout=10), "the background fetch did not start on construction"
    assert list(it) == [0, 1, 2, 3, 4]  # order kept, nothing lost or repeated


def test_the_first_item_is_ready_before_the_caller_asks_for_it() -> None:
    """The slow first read happens while the caller builds the model: it is done before next() is called
    (the overlap is shown by events, not by timing; the start-up gain is measured in bench/)."""
    fetched = threading.Event()
    later: list[str] = []

    def items():
        yield "first"
        fetched.set()  # runs only when a second item is asked for: it must not be, yet
        later.append("second asked")
        yield "second"

    it = StartEarly(items)
    it._thread.join(timeout=10)  # the background fetch finished on its own, without a next() from us
    assert not it._thread.is_alive() and it._first == ["first"] and not fetched.is_set()
    assert next(it) == "first" and later == []  # the first item came from the background fetch
    assert next(it) == "second"
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("where", ["making the iterator", "the first item", "a later item"])
def test_errors_reach_the_caller(where: str) -> None:
    from raytrn.errors import DataError

    def make():
        if where == "making the iterator":
            raise DataError("no shard")
        return items()

    def items():
        if where == "the first item":
            raise DataError("too small")
        yield 1
        raise DataError("bad row")

    it = StartEarly(make)
    if where == "a later item":
        assert next(it) == 1
    with pytest.raises(DataError):
        next(it)


def test_empty_stream_stops() -> None:
    assert list(StartEarly(lambda: iter(()))) == []
