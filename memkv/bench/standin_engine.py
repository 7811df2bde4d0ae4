"""A stand-in inference engine: vLLM's OpenAI routes, /health and /metrics, answering at
once with a fixed reply (``python -m memkv.bench.standin_engine PORT [EVENTS]``).

What the front-door benchmark puts behind the gateway to measure the gateway's
own cost per request: with no model to run, the time a request takes through
the gateway minus the time it takes straight to this server is the gateway's.
Streams send ``EVENTS`` events.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

MODEL = "standin"


def app(events: int) -> FastAPI:
    api = FastAPI()
    reply = json.dumps({
        "id": "cmpl-standin", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
    chunk = ("data: " + json.dumps({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})
             + "\n\n").encode()

    @api.get("/health")
    async def health() -> Any:
        return PlainTextResponse("")

    @api.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse("# TYPE vllm:num_requests_running gauge\n"
                                 "vllm:num_requests_running 0\n")

    @api.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        if not body.get("stream"):
            return Response(reply, media_type="application/json")

        async def stream() -> Any:
            for _ in range(events):
                yield chunk
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return api


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app(int(sys.argv[2]) if len(sys.argv) > 2 else 32), host="127.0.0.1",
                port=int(sys.argv[1]), log_level="warning", http="httptools", loop="uvloop")
