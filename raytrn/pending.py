"""An answer looked at later: a Ray call's future behind a typed face, so that a stand-in (a value at hand) reads the
same way and the caller never handles an untyped ``ObjectRef``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """An answer that may not be there yet."""

    def done(self) -> bool:
        """Whether the answer is there (never waits)."""
        ...

    def result(self, timeout_s: float | None = None) -> T_co:
        """The answer, waiting up to ``timeout_s`` (None: as long as it takes); raises what the call raised."""
        ...


class Ready(Generic[T]):
    """An answer at hand (an in-process board, a test's stand-in)."""

    def __init__(self, value: T) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout_s: float | None = None) -> T:
        return self.value


class RayPending(Generic[T]):
    """The answer of a Ray actor call (``ref``: its ``ObjectRef``)."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def done(self) -> bool:
        import ray  # the CLI imports this module's users; Ray's import (~1 s) waits until a call is made

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def result(self, timeout_s: float | None = None) -> T:
        import ray

        return ray.get(self.ref, timeout=timeout_s)  # type: ignore[no-any-return]


def wait_all(pendings: Sequence[Pending[Any]], timeout_s: float | None) -> list[bool]:
    """Waits up to ``timeout_s`` in all for every one of ``pendings`` (the Ray calls' answers in one ``ray.wait``:
    calls made together are waited for together, never one after another); whether each is done then."""
    refs = [p.ref for p in pendings if isinstance(p, RayPending)]
    ready: set[Any] = set()
    if refs:
        import ray

        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
    return [p.ref in ready if isinstance(p, RayPending) else p.done() for p in pendings]
