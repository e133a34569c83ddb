"""LightLLM's probe, load and name endpoints, with its methods, status codes and bodies (v1.2.0's api_http.py),
answered from what this server knows. While the server drains, DrainGate answers /healthz, /health and /readiness
with a 503 before they get here; /liveness stays 200 as long as the process serves HTTP."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from mmserve.http.engine_client import EngineClient
from mmserve.http.openai_protocol import OpenAIOptions
from mmserve.http.openapi import (
    HEALTHZ_ROUTE,
    LIVENESS_ROUTE,
    MODEL_NAME_ROUTE,
    READINESS_ROUTE,
    TOKEN_LOAD_ROUTE,
)


def token_load(client: EngineClient) -> dict[str, float]:
    """LightLLM's load figures, as fractions of the KV cache's token slots: `current_load` is what the running
    requests hold now; `logical_max_load` and `dynamic_max_load` (equal in LightLLM too) what they would hold at
    their peak, each at prompt + max_new_tokens. 0.0 until the router's first report."""
    stats = client.metrics.last_stats
    if stats is None or stats.engine.kv_total == 0:
        return {"current_load": 0.0, "logical_max_load": 0.0, "dynamic_max_load": 0.0}
    total = stats.engine.kv_total
    peak = stats.engine.peak_tokens / total
    return {"current_load": stats.engine.kv_used / total, "logical_max_load": peak, "dynamic_max_load": peak}


def add_lightllm_routes(app: FastAPI, client: EngineClient, options: OpenAIOptions) -> None:
    @app.api_route("/healthz", methods=["GET", "HEAD"], **HEALTHZ_ROUTE)
    async def healthz() -> Response:
        # degraded (the visual process is down, text is served) is still healthy, as /health says
        if client.healthy():
            return JSONResponse({"message": "Ok"})
        return JSONResponse({"message": "Error"}, status_code=503)

    @app.api_route("/liveness", methods=["GET", "POST"], **LIVENESS_ROUTE)
    async def liveness() -> Response:
        return JSONResponse({"status": "ok"})

    @app.api_route("/readiness", methods=["GET", "POST"], **READINESS_ROUTE)
    async def readiness() -> Response:
        if client.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "not ready"}, status_code=503)

    @app.api_route("/get_model_name", methods=["GET", "POST"], **MODEL_NAME_ROUTE)
    async def get_model_name() -> Response:
        return JSONResponse({"model_name": options.model_name(client.preparer.tokenizer)})

    @app.get("/token_load", **TOKEN_LOAD_ROUTE)
    async def get_token_load() -> Response:
        return JSONResponse(token_load(client))
