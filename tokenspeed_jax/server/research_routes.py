"""Research routes (issue 48), with the peers' spellings, behind the API key like every route:

* `POST /sleep?level=N` (vLLM): new requests get 503 at once; the ones in flight finish; then
  `LLM.sleep(N)` frees the KV pools (N=2: the weights too). Answers {"level", "freed_bytes"}.
* `POST /wake_up` (vLLM): `LLM.wake_up()`; requests are taken again.
* `GET /is_sleeping` (vLLM): {"is_sleeping": bool}.
* `POST /update_weights_from_disk` (SGLang) {"model_path": DIR, "abort_all_requests": false,
  "weight_version": null}: new requests get 503 while it runs; the requests in flight finish on
  the old weights (or are aborted with `abort_all_requests`); then `LLM.update_weights(DIR)`.
  Answers {"success", "message", "weight_version"}; a checkpoint that does not fit is a 400
  and the old weights keep serving.

Each engine call runs in a worker thread holding every replica's lock (`ReplicaState.urgent`):
between steps, never beside one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tokenspeed_jax.server.async_engine import AsyncEngine
from tokenspeed_jax.server.errors import error_response

POLL_S = 0.01  # how often a route waiting for the requests in flight looks again


class ResearchGate:
    """Whether new completion requests are refused (asleep, or weights being swapped)."""

    def __init__(self) -> None:
        self.asleep = False
        self.updating = False

    def refusal(self) -> JSONResponse | None:
        """The 503 a new completion request gets now, or None."""
        if self.asleep:
            return error_response(
                503,
                "the engine is asleep (POST /sleep): POST /wake_up before sending requests",
                code="engine_sleeping",
            )
        if self.updating:
            return error_response(
                503,
                "the weights are being updated; retry in a moment",
                code="updating_weights",
                headers={"Retry-After": "1"},
            )
        return None


def _locked(engine: AsyncEngine, fn: Callable[[], Any]) -> Any:
    """fn() with every replica's lock held (between steps)."""
    with contextlib.ExitStack() as stack:
        for rep in engine.replicas:
            stack.enter_context(rep.urgent())
        return fn()


async def _settle(engine: AsyncEngine, abort: bool) -> None:
    """Wait until no request is live (or abort them all first)."""
    if abort:
        engine.abort_all("aborted: the weights are being updated")
    while engine.num_live():
        await asyncio.sleep(POLL_S)


def add_research_routes(
    app: FastAPI, llm: Any, engine: Callable[[], AsyncEngine], gate: ResearchGate
) -> None:
    """The four routes above, on `app`, over `llm` (its engines are the ones `engine()` steps)."""
    lock = asyncio.Lock()  # one research operation at a time

    @app.post("/sleep")
    async def sleep(level: int = 1):
        if level not in (1, 2):
            return error_response(400, f"level must be 1 or 2, got {level}", param="level")
        async with lock:
            was_asleep, gate.asleep = gate.asleep, True
            await _settle(engine(), abort=False)
            try:
                out = await asyncio.to_thread(_locked, engine(), lambda: llm.sleep(level))
            except ValueError as e:  # e.g. the multi-process runtime: keep serving
                gate.asleep = was_asleep
                return error_response(400, str(e))
        return {"level": level, "freed_bytes": out["freed_bytes"]}

    @app.post("/wake_up")
    async def wake_up():
        async with lock:
            try:
                out = await asyncio.to_thread(_locked, engine(), llm.wake_up)
            except ValueError as e:
                return error_response(400, str(e))
            gate.asleep = False
        return {"is_sleeping": False, "seconds": out["seconds"]}

    @app.get("/is_sleeping")
    def is_sleeping():
        return {"is_sleeping": bool(llm.is_sleeping)}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(http: Request):
        try:
            body = await http.json()
        except ValueError:
            return error_response(400, 'the body must be JSON: {"model_path": DIR}')
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            return error_response(400, "model_path (a checkpoint directory) is required", param="model_path")
        version = body.get("weight_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            return error_response(
                400, f"weight_version must be an int, got {version!r}", param="weight_version"
            )
        async with lock:
            gate.updating = True
            try:
                await _settle(engine(), abort=bool(body.get("abort_all_requests", False)))
                out = await asyncio.to_thread(
                    _locked,
                    engine(),
                    lambda: llm.update_weights(path, in_flight="abort", weight_version=version),
                )
            except ValueError as e:
                return JSONResponse(status_code=400, content={"success": False, "message": str(e)})
            finally:
                gate.updating = False
        return {
            "success": True,
            "message": f"weights updated from {path} in {out['seconds']:.2f}s",
            "weight_version": out["weight_version"],
        }
