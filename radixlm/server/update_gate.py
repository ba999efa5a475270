"""The model-update gate (SGLang's model-update lock).

While a weight update runs the gate is closed: new generate requests wait at
it in the TokenizerManager, and the update first waits for (or aborts) the
running ones, so no request sees two sets of weights. The gate knows nothing
of requests itself; whoever closes it says how to stop them (`drain`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable


class UpdateGate:
    """While closed, `wait_open` blocks (new requests queue in the front end)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._lock = asyncio.Lock()

    async def wait_open(self) -> None:
        if not self._open.is_set():
            await self._open.wait()

    @contextlib.asynccontextmanager
    async def closed(self, drain: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
        """Close the gate, `await drain()` (the running requests end), run the body,
        reopen. Updates run one at a time."""
        async with self._lock:
            self._open.clear()
            try:
                await drain()
                yield
            finally:
                self._open.set()
