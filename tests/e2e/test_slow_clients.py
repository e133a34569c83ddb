"""Slow and vanishing clients cannot pin KV slots or connections (tiny random Llama, CPU): streams dropped after
their first token give back every KV slot (a request needing nearly all of them then runs), a stream whose client
stops reading is aborted after --stream_write_timeout, and an upload that trickles gets a 408 after
--request_read_timeout."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from transformers import AutoTokenizer

from mmserve.testing.server_proc import ServerProcess, serving

KV_SLOTS = 4096


@pytest.fixture(scope="module")
def server(e2e_model_dir, tmp_path_factory):
    srv = ServerProcess(e2e_model_dir, str(tmp_path_factory.mktemp("log") / "server.log"),
                        "--max_total_token_num", str(KV_SLOTS), "--stream_write_timeout", "1",
                        "--request_read_timeout", "2")  # fmt: skip
    with serving(srv):
        yield srv


def open_stream(srv: ServerProcess, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """A raw HTTP/1.1 connection with a /generate_stream request sent (nothing read yet)."""
    sock = socket.socket()
    if rcvbuf is not None:  # a small window: the server's buffers fill sooner
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", srv.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    return sock


def read_first_event(sock: socket.socket) -> None:
    buf = b""
    while b"data:" not in buf:
        chunk = sock.recv(4096)
        assert chunk, buf
        buf += chunk
    assert buf.startswith(b"HTTP/1.1 200"), buf


def test_64_streams_dropped_after_their_first_token_give_back_every_kv_slot(server, e2e_model_dir):
    socks = []
    for i in range(64):
        body = {"inputs": f"Story number {i}:", "parameters": {"max_new_tokens": 200, "ignore_eos": True}}
        socks.append(open_stream(server, body))
    for sock in socks:
        read_first_event(sock)
        sock.close()  # gone without reading on
    server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)
    assert server.metrics()["mmserve_requests_running"] == 0
    # A request that needs nearly every slot (it is only admitted if all came back).
    tokenizer = AutoTokenizer.from_pretrained(e2e_model_dir)
    words = KV_SLOTS - 40
    prompt = " ".join(["go"] * words)
    while len(tokenizer(prompt)["input_ids"]) > KV_SLOTS - 16:
        words -= 8
        prompt = " ".join(["go"] * words)
    big = {"inputs": prompt, "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    r = httpx.post(server.url + "/generate", json=big, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["count_output_tokens"] == 8 and r.json()["prompt_tokens"] >= KV_SLOTS - 64


def test_a_stream_whose_client_stops_reading_is_aborted(server):
    before = server.metrics()["mmserve_generated_tokens_total"]
    body = {"inputs": "Never read:", "parameters": {"max_new_tokens": 3500, "ignore_eos": True}}
    sock = open_stream(server, body, rcvbuf=4096)
    try:
        read_first_event(sock)  # then nothing more is read: the server's send buffers fill up
        server.wait_metric("mmserve_requests_running", lambda v: v == 0, timeout_s=60)
        server.wait_metric("mmserve_kv_tokens_used", lambda v: v == 0)
        generated = server.metrics()["mmserve_generated_tokens_total"] - before
        assert generated < 3500  # aborted, not run to its end
        sock.settimeout(10)
        while sock.recv(65536):  # the server dropped the connection: what it had buffered is discarded
            pass
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    assert "read nothing for 1 s (--stream_write_timeout)" in server.log()


def test_an_upload_that_trickles_gets_a_408(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"inputs\": ")  # fmt: skip
        start = time.monotonic()
        sock.settimeout(30)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        assert time.monotonic() - start < 10
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--request_read_timeout" in reply
    assert httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).is_success
