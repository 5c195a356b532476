"""OpenAI-compatible HTTP API (placeholder: health only)."""

from __future__ import annotations

from fastapi import FastAPI

from gateway.core import GatewayCore


def create_app(core: GatewayCore) -> FastAPI:
    app = FastAPI()

    @app.get("/health/live")
    async def live() -> dict:
        return {"status": "live"}

    return app
