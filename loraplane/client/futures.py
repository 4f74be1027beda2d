"""APIFuture: the result of a submitted call, usable from threads (`.result(timeout)`) and from asyncio (`await`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    """Wraps a concurrent.futures.Future completed by the client's I/O loop. Await it, or block on `result()`."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        wrapped = asyncio.wrap_future(self._future)
        return await (asyncio.wait_for(wrapped, timeout) if timeout is not None else wrapped)

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, callback: Callable[[APIFuture[T]], Any]) -> None:
        self._future.add_done_callback(lambda _f: callback(self))

    def map(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of `fn(result)` (errors propagate)."""
        mapped: concurrent.futures.Future = concurrent.futures.Future()

        def relay(done: concurrent.futures.Future) -> None:
            if done.cancelled():
                mapped.cancel()
                return
            error = done.exception()
            if error is not None:
                mapped.set_exception(error)
                return
            try:
                mapped.set_result(fn(done.result()))
            except BaseException as exc:  # noqa: BLE001
                mapped.set_exception(exc)

        self._future.add_done_callback(relay)
        return APIFuture(mapped)

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(value)
        return cls(future)
