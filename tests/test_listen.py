"""``pdpool.utils``: URLs from a host and a port (an IPv6 literal in brackets) and the sockets a server binds
(``--host`` unset: IPv4 and IPv6, a family this machine lacks left out; a named host exactly its addresses)."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hypothesis import given, strategies as st

from pdpool import utils
from pdpool.utils import bind_sockets, http_url, url_host

sys.path.insert(0, str(Path(__file__).resolve().parent))
from listen_checks import has_ipv6_loopback  # noqa: E402

addresses = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)).map(str)
ports = st.integers(0, 65535)


@given(addresses, ports)
def test_a_url_reads_back_as_its_host_and_port(address, port):
    url = http_url(address, port, "/internal/x?a=1")
    parts = urlsplit(url)   # raises "Invalid IPv6 URL" for an unbracketed literal
    assert ipaddress.ip_address(parts.hostname) == ipaddress.ip_address(address)
    assert parts.port == port and parts.path == "/internal/x" and parts.query == "a=1"
    assert url_host(url_host(address)) == url_host(address)   # a bracketed literal is left as it is


@pytest.mark.parametrize("host", ["node-0.pool.svc", "localhost", "10.1.2.3"])
def test_a_name_or_ipv4_address_is_written_as_it_is(host):
    assert http_url(host, 8000) == f"http://{host}:8000"


def test_the_advertised_url_of_an_ipv6_pod():
    assert http_url("fd00::1", 8000) == "http://[fd00::1]:8000"


def _close(sockets):
    for s in sockets:
        s.close()


def test_every_address_is_ipv4_and_ipv6_on_one_port():
    sockets = bind_sockets(None, 0)
    try:
        names = {s.family: s.getsockname() for s in sockets}
        assert names[socket.AF_INET][0] == "0.0.0.0"
        if socket.has_ipv6:
            assert names[socket.AF_INET6][0] == "::"
            assert len({name[1] for name in names.values()}) == 1   # port 0: the same port for both
            six = next(s for s in sockets if s.family == socket.AF_INET6)
            assert six.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
    finally:
        _close(sockets)


def test_a_named_host_binds_exactly_it():
    sockets = bind_sockets("127.0.0.1", 0)
    try:
        assert [s.getsockname()[0] for s in sockets] == ["127.0.0.1"]
    finally:
        _close(sockets)


def test_reuse_port_lets_two_workers_share_the_port():
    first = bind_sockets(None, 0, reuse_port=True)
    try:
        for s in first:
            s.listen()
        second = bind_sockets(None, first[0].getsockname()[1], reuse_port=True)
        assert len(second) == len(first)
        _close(second)
        with pytest.raises(OSError) as info:
            bind_sockets(None, first[0].getsockname()[1])   # without SO_REUSEPORT: taken (check_port_free)
        assert info.value.errno == errno.EADDRINUSE
    finally:
        _close(first)


_REAL_SOCKET = socket.socket


class _NoIPv6Socket(socket.socket):
    """A socket of a machine whose IPv6 is off (a container with net.ipv6.conf.all.disable_ipv6=1)."""

    def bind(self, address):
        if self.family == socket.AF_INET6:
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
        return super().bind(address)


def _no_ipv6_family(family=socket.AF_INET, *args, **kwargs):
    """socket() of a kernel without IPv6."""
    if family == socket.AF_INET6:
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
    return _REAL_SOCKET(family, *args, **kwargs)


@pytest.mark.parametrize("no_ipv6", [_NoIPv6Socket, _no_ipv6_family], ids=["disabled", "not-in-kernel"])
def test_every_address_without_ipv6_is_ipv4_alone(monkeypatch, no_ipv6):
    monkeypatch.setattr(utils.socket, "socket", no_ipv6)
    sockets = bind_sockets(None, 0)
    try:
        assert [s.getsockname()[0] for s in sockets] == ["0.0.0.0"]
    finally:
        _close(sockets)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_named_ipv6_host_that_cannot_be_bound_is_an_error(monkeypatch):
    monkeypatch.setattr(utils.socket, "socket", _NoIPv6Socket)
    with pytest.raises(OSError, match="cannot bind ::1"):
        bind_sockets("::1", 0)
