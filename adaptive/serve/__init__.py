"""The OpenAI-compatible server (``adaptive serve``): wire format (:mod:`.protocol`), metrics
(:mod:`.metrics`), the decoding worker (:mod:`.scheduler`) and the ASGI app (:mod:`.app`, which
needs the ``serve`` extra: Starlette and uvicorn)."""
