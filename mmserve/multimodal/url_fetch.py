"""Downloading an image URL without letting a request reach into the server's own network.

Only http and https; every hop's host is resolved and refused if any address is loopback, private, link-local,
multicast, reserved or unspecified (unless the policy allows private networks), and the connection then goes to the
address that was checked (so a second DNS answer cannot swap in another one). Redirects are followed by hand, each
hop checked again. The body is streamed and cut off at the byte cap; the whole fetch has one deadline.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from urllib.parse import urljoin

import httpx


class UrlRefused(ValueError):
    """The URL may not be fetched, or fetching it failed; the message is safe to show the client."""


@dataclass(frozen=True)
class FetchPolicy:
    timeout_s: float = 10.0  # the whole fetch, redirects included
    max_redirects: int = 5
    allow_private: bool = False  # --allow_private_urls: users whose images live on their own network


_REDIRECTS = {301, 302, 303, 307, 308}


def _is_public(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return not (
        addr.is_loopback
        or addr.is_private
        or addr.is_link_local
        or addr.is_multicast
        or addr.is_reserved
        or addr.is_unspecified
        or not addr.is_global
    )


def resolve_checked(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to for host, after checking all its addresses."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UrlRefused(f"cannot resolve image host {host!r}: {e}") from None
    addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not allow_private:
        bad = [str(a) for a in addrs if not _is_public(a)]
        if bad:
            raise UrlRefused(
                f"image host {host!r} resolves to a non-public address ({', '.join(bad)}); "
                "the server does not fetch from private networks"
            )
    return str(addrs[0])


def _pinned_request(client: httpx.Client, url: httpx.URL, ip: str) -> httpx.Request:
    """A GET for `url` that connects to `ip`, keeping the Host header (and TLS name) of the URL."""
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    headers = {"Host": url.netloc.decode("ascii")}
    return client.build_request("GET", url.copy_with(host=ip), headers=headers, extensions=extensions)


def fetch_url(url: str, policy: FetchPolicy, max_bytes: int) -> bytes:
    deadline = time.monotonic() + policy.timeout_s
    with httpx.Client(timeout=policy.timeout_s, follow_redirects=False, trust_env=False) as client:
        for _ in range(policy.max_redirects + 1):
            try:
                parsed = httpx.URL(url)
            except (httpx.InvalidURL, TypeError) as e:
                raise UrlRefused(f"invalid image URL: {e}") from None
            if parsed.scheme not in ("http", "https"):
                raise UrlRefused(f"image URLs must be http or https, not {parsed.scheme or 'a path'!r}")
            if not parsed.host:
                raise UrlRefused("image URL has no host")
            port = parsed.port or (443 if parsed.scheme == "https" else 80)
            ip = resolve_checked(parsed.host, port, policy.allow_private)
            try:
                response = client.send(_pinned_request(client, parsed, ip), stream=True)
            except httpx.HTTPError as e:
                raise UrlRefused(f"fetching the image URL failed: {type(e).__name__}: {e}") from None
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = urljoin(str(parsed), response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise UrlRefused(f"fetching the image URL gave HTTP {response.status_code}")
                return _read_capped(response, max_bytes, deadline)
            finally:
                response.close()
    raise UrlRefused(f"image URL redirected more than {policy.max_redirects} times")


def _read_capped(response: httpx.Response, max_bytes: int, deadline: float) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise UrlRefused(f"image at URL is larger than {max_bytes} bytes")
    body = bytearray()
    try:
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise UrlRefused(f"image at URL is larger than {max_bytes} bytes")
            if time.monotonic() > deadline:
                raise UrlRefused("fetching the image URL timed out")
    except httpx.HTTPError as e:
        raise UrlRefused(f"fetching the image URL failed: {type(e).__name__}: {e}") from None
    return bytes(body)
