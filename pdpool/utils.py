"""Small helpers shared across the package (no third-party imports)."""

from __future__ import annotations

import errno
import socket


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


def url_host(host: str) -> str:
    """``host`` as a URL's authority writes it: an IPv6 literal in brackets (RFC 3986 3.2.2), as ``fd00::1`` ->
    ``[fd00::1]``; a name, an IPv4 address or an already bracketed literal unchanged."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def http_url(host: str, port: int, path: str = "") -> str:
    """``http://host:port`` plus ``path``, ``host`` bracketed when it is an IPv6 literal (``url_host``)."""
    return f"http://{url_host(host)}:{port}{path}"


# What socket() or bind() of a family this machine lacks fails with: no IPv6 in the kernel (EAFNOSUPPORT), or
# IPv6 disabled by sysctl, as in many containers (EADDRNOTAVAIL for ::).
_NO_SUCH_FAMILY = {errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT}


def bind_sockets(host: str | None, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """Bound TCP sockets (not yet listening) for a server on ``host:port``, each address its own socket, as
    ``asyncio``'s ``create_server`` binds them: SO_REUSEADDR, IPV6_V6ONLY on IPv6, SO_REUSEPORT if asked.

    ``host`` None or "": every address of every family this machine has (``0.0.0.0`` and ``::``); a family it lacks
    is skipped, where Python 3.11's asyncio and uvloop fail the whole server on it; with port 0 every socket takes
    the first one's port. A named host binds exactly its addresses, and any failure raises ``OSError``."""
    wildcard = not host
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):   # getaddrinfo may repeat an address
            if sockets and port == 0 and wildcard:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:
                if wildcard and exc.errno in _NO_SUCH_FAMILY:
                    continue
                raise
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
            except OSError as exc:
                sock.close()
                if wildcard and family == socket.AF_INET6 and exc.errno in _NO_SUCH_FAMILY:
                    continue
                raise OSError(exc.errno, f"cannot bind {address[0]} port {address[1]}: {exc.strerror}") from None
            sockets.append(sock)
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host or 'every address'}")
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
