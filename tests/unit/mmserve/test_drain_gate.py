"""The drain gate: once draining, new requests and /health get a 503 JSON error with Retry-After; /metrics still
answers; requests let in are counted until answered."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from mmserve.http.drain import DrainGate


def make_gate() -> DrainGate:
    async def ok(request):
        return PlainTextResponse("ok")

    paths = ("/generate", "/health", "/metrics", "/healthz", "/readiness", "/liveness")
    routes = [Route(path, ok, methods=["GET", "POST"]) for path in paths]
    return DrainGate(Starlette(routes=routes))


async def call(gate: DrainGate, method: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://test") as client:
        return await client.request(method, path)


def test_open_until_draining_then_503_with_retry_after():
    gate = make_gate()
    assert asyncio.run(call(gate, "POST", "/generate")).status_code == 200
    assert gate.active == 0
    gate.draining = True
    refused = asyncio.run(call(gate, "POST", "/generate"))
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
    assert "shutting down" in refused.json()["error"]
    health = asyncio.run(call(gate, "GET", "/health"))
    assert health.status_code == 503 and health.json()["status"] == "draining" and "retry-after" in health.headers
    assert asyncio.run(call(gate, "GET", "/metrics")).status_code == 200
    assert gate.active == 0


def test_probes_while_draining_say_not_ready_yet_alive():
    """LightLLM's probes: /readiness and /healthz fail in their own shape (a load balancer takes the server out);
    /liveness still answers (an orchestrator must not kill the server while its requests finish)."""
    gate = make_gate()
    gate.draining = True
    ready = asyncio.run(call(gate, "GET", "/readiness"))
    assert ready.status_code == 503 and ready.json()["status"] == "not ready"
    healthz = asyncio.run(call(gate, "GET", "/healthz"))
    assert healthz.status_code == 503 and healthz.json()["message"] == "Error"
    assert asyncio.run(call(gate, "GET", "/health")).json()["message"] == "Error"
    assert asyncio.run(call(gate, "GET", "/liveness")).status_code == 200


def test_a_request_in_flight_is_counted_until_answered():
    release = asyncio.Event()
    seen = []

    async def slow(scope, receive, send):
        seen.append(gate.active)
        await release.wait()
        await PlainTextResponse("done")(scope, receive, send)

    gate = DrainGate(slow)

    async def scenario():
        task = asyncio.ensure_future(call(gate, "POST", "/generate"))
        while not seen:
            await asyncio.sleep(0.01)
        gate.draining = True  # a drain starts: the request let in before it still completes
        assert gate.active == 1
        release.set()
        return await task

    assert asyncio.run(scenario()).text == "done"
    assert seen == [1] and gate.active == 0
