"""JSON answers rendered by orjson, the data path's JSON library: the body of every non-streamed completion on
the router and the workers, and a worker's prefill answer (non-finite floats become null, not an error).
FastAPI's own ORJSONResponse does the same but is deprecated there."""

from __future__ import annotations

import orjson
from starlette.responses import JSONResponse


class FastJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return orjson.dumps(content)
