"""Downloading an image URL without letting a request reach into the server's own network.

Only http and https; every hop's host is resolved and refused if any address is loopback, private, link-local,
multicast, reserved or unspecified (unless the policy allows private networks), and the connection then goes to the
address that was checked (so a second DNS answer cannot swap in another one). Redirects are followed by hand, each
hop checked again. The body is streamed and cut off at the byte cap; the whole fetch has one deadline. Fetching runs
on the event loop (`UrlFetcher`), so a URL that never answers holds a socket, never a thread.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
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


async def resolve_checked(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to for host, after checking all its addresses (resolved in the loop's executor)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
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


def _pinned_request(client: httpx.AsyncClient, url: httpx.URL, ip: str) -> httpx.Request:
    """A GET for `url` that connects to `ip`, keeping the Host header (and TLS name) of the URL."""
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    headers = {"Host": url.netloc.decode("ascii")}
    return client.build_request("GET", url.copy_with(host=ip), headers=headers, extensions=extensions)


class UrlFetcher:
    """Downloads image URLs on the event loop: a fetch that waits holds a socket, not a thread, so one request's
    never-answering URLs cannot delay anyone else's images. One per server (its TLS context is built once, ~10 ms of
    CPU); connections are not kept alive, so a connection opened for one host name is never reused for another name
    on the same address."""

    def __init__(self, policy: FetchPolicy = FetchPolicy()) -> None:
        self.policy = policy
        self._client = httpx.AsyncClient(
            timeout=policy.timeout_s,
            follow_redirects=False,
            trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    async def fetch(self, url: str, max_bytes: int, what: str = "image") -> bytes:
        """The body at `url`, at most max_bytes, all within the policy's deadline (headers and redirects included:
        a per-read timeout alone lets a host that trickles a byte at a time hold the request indefinitely). `what`
        the URL should hold ("image", "video"), for the messages."""
        try:
            return await asyncio.wait_for(self._fetch(url, max_bytes, what), self.policy.timeout_s)
        except asyncio.TimeoutError:
            raise UrlRefused(f"fetching the {what} URL timed out after {self.policy.timeout_s:g} s") from None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _fetch(self, url: str, max_bytes: int, what: str) -> bytes:
        for _ in range(self.policy.max_redirects + 1):
            parsed = _checked_url(url, what)
            port = parsed.port or (443 if parsed.scheme == "https" else 80)
            ip = await resolve_checked(parsed.host, port, self.policy.allow_private)
            try:
                response = await self._client.send(_pinned_request(self._client, parsed, ip), stream=True)
            except httpx.HTTPError as e:
                raise UrlRefused(f"fetching the {what} URL failed: {type(e).__name__}: {e}") from None
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = urljoin(str(parsed), response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise UrlRefused(f"fetching the {what} URL gave HTTP {response.status_code}")
                return await _read_capped(response, max_bytes, what)
            finally:
                await response.aclose()
        raise UrlRefused(f"{what} URL redirected more than {self.policy.max_redirects} times")


def _checked_url(url: str, what: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise UrlRefused(f"invalid {what} URL: {e}") from None
    if parsed.scheme not in ("http", "https"):
        raise UrlRefused(f"{what} URLs must be http or https, not {parsed.scheme or 'a path'!r}")
    if not parsed.host:
        raise UrlRefused(f"{what} URL has no host")
    return parsed


async def _read_capped(response: httpx.Response, max_bytes: int, what: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise UrlRefused(f"{what} at URL {too_large(what, max_bytes)}")
    body = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise UrlRefused(f"{what} at URL {too_large(what, max_bytes)}")
    except httpx.HTTPError as e:
        raise UrlRefused(f"fetching the {what} URL failed: {type(e).__name__}: {e}") from None
    return bytes(body)


# The server flag that bounds each kind of file (images have a fixed bound).
_BYTE_LIMIT_FLAGS = {"video": "--max_video_bytes"}


def too_large(what: str, max_bytes: int) -> str:
    """The end of a refusal for a file over its byte limit, naming the flag that sets the limit where there is one."""
    flag = _BYTE_LIMIT_FLAGS.get(what)
    return f"is larger than {max_bytes} bytes" + (f" ({flag})" if flag else "")
