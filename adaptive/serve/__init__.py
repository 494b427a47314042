"""The OpenAI-compatible server (``adaptive serve``): wire format (:mod:`.protocol`), metrics
(:mod:`.metrics`), the decoding worker (:mod:`.scheduler`) and the ASGI app (:mod:`.app`, which
needs the ``serve`` extra: Starlette and uvicorn)."""

DEFAULT_PREFILL_CHUNK = 128  # prompt tokens prefilled between two decoding steps (:mod:`.scheduler` says why)
