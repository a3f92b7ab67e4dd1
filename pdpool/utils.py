"""Small helpers shared across the package (no third-party imports)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of ``b``-sized blocks that hold ``a`` items."""
    return -(-a // b)


async def wait_for_stop_signal(stop: "asyncio.Event | None" = None) -> None:
    """Wait until ``stop`` is set or SIGINT/SIGTERM arrives (a server's main wait)."""
    import asyncio
    import signal

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    await stop.wait()
