import asyncio
import base64
import io
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from mmserve.prep.multimodal import url_fetch
from mmserve.prep.multimodal.image_io import (
    BadImage,
    ImagePolicy,
    decode_base64,
    fetch_item,
    load_image,
    load_images,
)
from mmserve.prep.multimodal.url_fetch import FetchPolicy, UrlFetcher
from tests.fake_image_host import hostile_host


def png_bytes(width=20, height=12, color=(200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(width=64, height=48) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((width, height), 60).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


def bomb_png(width=100_000, height=100_000) -> bytes:
    """A tiny file whose header declares a huge image (valid IHDR CRC, so only the size check can stop it)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    idat = zlib.compress(b"\x00" * 16)
    idat_chunk = struct.pack(">I", len(idat)) + b"IDAT" + idat + struct.pack(">I", zlib.crc32(b"IDAT" + idat))
    return b"\x89PNG\r\n\x1a\n" + chunk + idat_chunk


def b64(data: bytes) -> dict:
    return {"type": "base64", "data": base64.b64encode(data).decode()}


def test_base64_png_and_data_url():
    data = png_bytes()
    loaded = load_image(b64(data))
    assert (loaded.width, loaded.height) == (20, 12) and loaded.data == data
    assert loaded.image.getpixel((0, 0)) == (200, 30, 40)
    data_url = {"type": "base64", "data": "data:image/png;base64," + base64.b64encode(data).decode()}
    assert load_image(data_url).data == data


@pytest.mark.parametrize(
    "text",
    ["QUJD", "QUJ=", "QQ==", "QUJD=", "QUJD==", "QUJD\nRA==", " QUJD ", "QUJD+/==", "QQ=", "=QUJD", "QUJDé", "Q Q=="],
)
def test_base64_decodes_as_the_standard_library_does(text):
    """pybase64 first, the standard library for what it refuses: together they accept and refuse what
    `base64.b64decode(validate=True)` does (after stripping whitespace), with the same bytes."""
    try:
        want = base64.b64decode("".join(text.split()), validate=True)
    except ValueError:  # binascii.Error is a ValueError
        with pytest.raises(BadImage, match="malformed base64"):
            decode_base64(text, 1 << 20)
    else:
        assert decode_base64(text, 1 << 20) == want


@pytest.mark.parametrize(
    "item, message",
    [
        ({"type": "base64", "data": "not base64 at all!!"}, "malformed base64"),
        ({"type": "base64", "data": "abc"}, "malformed base64"),
        (b64(b"hello, I am not an image"), "not a readable image"),
        (b64(png_bytes()[:-30]), "truncated or corrupt"),
        (b64(jpeg_bytes()[: len(jpeg_bytes()) // 2]), "truncated or corrupt"),
        (b64(bomb_png()), "pixels"),
        ({"type": "file", "data": "/etc/passwd"}, "unknown image type"),
        ({"type": "base64"}, "non-empty string"),
        ("just a string", "each image must be an object"),
        ({"type": "url", "data": "file:///etc/passwd"}, "http or https"),
        ({"type": "url", "data": "/etc/passwd"}, "http or https"),
        ({"type": "url", "data": "ftp://example.com/a.png"}, "http or https"),
    ],
)
def test_bad_inputs(item, message):
    with pytest.raises(BadImage, match=message):
        asyncio.run(load_images([item]))


def test_pixel_cap_is_configurable():
    with pytest.raises(BadImage, match="more than the limit of 100"):
        load_image(b64(png_bytes(20, 12)), ImagePolicy(max_pixels=100))


def test_byte_cap_on_base64():
    with pytest.raises(BadImage, match="larger than"):
        load_image(b64(png_bytes()), ImagePolicy(max_bytes=10))


def test_load_images_reports_the_failing_index():
    async def main():
        good = await load_images([b64(png_bytes()), b64(jpeg_bytes())])
        assert [(i.width, i.height) for i in good] == [(20, 12), (64, 48)]
        with pytest.raises(BadImage, match="image 1: "):
            await load_images([b64(png_bytes()), {"type": "nope", "data": "x"}])

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ URLs, on a real server


class _Handler(BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802 - http.server's naming
        status, headers, body = self.routes.get(self.path, (404, {}, b"not found"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    port = httpd.server_address[1]
    base = f"http://127.0.0.1:{port}"
    _Handler.routes = {
        "/a.png": (200, {"Content-Type": "image/png"}, png_bytes(30, 10)),
        "/redirect": (302, {"Location": "/a.png"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
        "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
        "/to-other-host": (302, {"Location": f"http://127.0.0.2:{port}/a.png"}, b""),
        "/big": (200, {}, b"x" * 5000),
        "/text": (200, {}, b"this is not an image"),
    }
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield base
    httpd.shutdown()


ALLOW = ImagePolicy(fetch=FetchPolicy(allow_private=True, timeout_s=5))


def load_url(url: str, policy: ImagePolicy | None = None):
    """One URL entry as the server loads it: downloaded on the event loop, then decoded."""
    return asyncio.run(load_images([{"type": "url", "data": url}], policy or ImagePolicy()))[0]


def test_loopback_refused_by_default(server):
    with pytest.raises(BadImage, match="non-public address"):
        load_url(server + "/a.png")
    with pytest.raises(BadImage, match="non-public address"):
        load_url(server.replace("127.0.0.1", "localhost") + "/a.png")


def test_allowed_with_the_flag(server):
    loaded = load_url(server + "/a.png", ALLOW)
    assert (loaded.width, loaded.height) == (30, 10)
    assert load_url(server + "/redirect", ALLOW).data == png_bytes(30, 10)


@pytest.mark.parametrize(
    "path, message",
    [
        ("/missing", "HTTP 404"),
        ("/loop", "redirected more than"),
        ("/to-file", "http or https"),
        ("/text", "not a readable image"),
    ],
)
def test_url_failures(server, path, message):
    with pytest.raises(BadImage, match=message):
        load_url(server + path, ALLOW)


def test_url_byte_cap(server):
    with pytest.raises(BadImage, match="larger than 1000 bytes"):
        load_url(server + "/big", ImagePolicy(max_bytes=1000, fetch=ALLOW.fetch))


def test_a_video_over_its_byte_cap_names_the_flag(server):
    """Sent inline or by URL, a video over --max_video_bytes is refused in words that say it is a video and which
    flag bounds it; an image's fixed bound names none."""

    async def fetch(path: str, what: str) -> None:
        fetcher = UrlFetcher(ALLOW.fetch)
        try:
            await fetch_item({"type": "url", "data": server + path}, fetcher, 1000, what)
        finally:
            await fetcher.aclose()

    with pytest.raises(BadImage, match=r"^video at URL is larger than 1000 bytes \(--max_video_bytes\)$"):
        asyncio.run(fetch("/big", "video"))
    with pytest.raises(BadImage, match=r"^fetching the video URL gave HTTP 404$"):
        asyncio.run(fetch("/missing", "video"))
    with pytest.raises(BadImage, match=r"^video is larger than 10 bytes \(--max_video_bytes\)$"):
        decode_base64(base64.b64encode(b"x" * 20).decode(), 10, "video")
    with pytest.raises(BadImage, match=r"^image at URL is larger than 1000 bytes$"):
        asyncio.run(fetch("/big", "image"))


def test_every_redirect_hop_is_checked(server, monkeypatch):
    """Pretend 127.0.0.1 is public and 127.0.0.2 is not: the first hop passes, the redirected one is refused."""
    monkeypatch.setattr(url_fetch, "_is_public", lambda addr: str(addr) != "127.0.0.2")
    assert load_url(server + "/a.png").width == 30
    with pytest.raises(BadImage, match="non-public address"):
        load_url(server + "/to-other-host")


@pytest.mark.parametrize(
    "addr",
    [
        "127.0.0.1",
        "10.1.2.3",
        "192.168.0.1",
        "169.254.169.254",
        "224.0.0.1",
        "0.0.0.0",
        "::1",
        "fe80::1",
        "::ffff:127.0.0.1",
        "240.0.0.1",
        "100.64.0.1",
    ],
)
def test_non_public_addresses(addr):
    import ipaddress

    assert not url_fetch._is_public(ipaddress.ip_address(addr))
    assert url_fetch._is_public(ipaddress.ip_address("93.184.216.34"))


def test_the_deadline_covers_headers_that_trickle_in():
    """Each header byte comes within the read timeout, so only a deadline over the whole fetch stops it."""
    policy = ImagePolicy(fetch=FetchPolicy(allow_private=True, timeout_s=1.5))
    with hostile_host(trickle_s=0.2) as host:
        start = time.monotonic()
        with pytest.raises(BadImage, match=r"timed out after 1.5 s"):
            load_url(host.url + "/trickle", policy)
        assert time.monotonic() - start < 3  # the headers alone would take ~50 s
        with pytest.raises(BadImage, match=r"timed out after 1.5 s"):
            load_url(host.url + "/hang", policy)


def test_urls_that_never_answer_hold_no_thread():
    """16 fetches waiting on a silent host take none of the decoding threads: a base64 image of another request,
    decoded on a pool of 2 threads meanwhile, is not delayed."""
    policy = ImagePolicy(fetch=FetchPolicy(allow_private=True, timeout_s=3))
    pool = ThreadPoolExecutor(2)

    async def main():
        waiting = asyncio.ensure_future(load_images([{"type": "url", "data": host.url + "/hang"}] * 16, policy, pool))
        while host.requests < 16:
            await asyncio.sleep(0.02)
        start = time.monotonic()
        (loaded,) = await load_images([b64(png_bytes())], policy, pool)
        took = time.monotonic() - start
        with pytest.raises(BadImage, match="timed out"):
            await waiting
        return loaded, took

    with hostile_host() as host:
        loaded, took = asyncio.run(main())
    pool.shutdown()
    assert loaded.width == 20 and took < 1.0
