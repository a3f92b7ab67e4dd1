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


def raise_open_files_limit(target: int = 65536) -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to ``target`` (at most the hard limit), as vLLM's and SGLang's
    servers do at start; returns the (soft, hard) limits in force. A container runtime may start a process with a
    soft limit of 1024 (containerd 2 does), and a router holds a client socket and a node socket for every request
    in flight: at the default it stalls at a few hundred concurrent requests, accepting nothing more. Never lowers
    a limit; a refusal (a sandbox) is logged and the limit kept."""
    import logging
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            logging.getLogger("pdpool").warning("cannot raise the open-files limit from %d to %d: %s", soft, want,
                                                exc)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft, hard


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``); False where there is no glibc.

    glibc keeps the memory a process frees for its next allocations, so after a burst of work a node's RSS stays at
    its high-water mark although nothing holds it (docs/performance.md, "Node memory under load": about 160 MiB on
    the demo model). A trim walks the arenas (milliseconds), so the engine calls it only once it has gone idle."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):   # musl, macOS: no malloc_trim
        return False
    trim(0)
    return True
