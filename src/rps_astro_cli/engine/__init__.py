"""Engines astro serves behind its scheduler: the embedded sim engine (an OpenAI-
compatible server running the instance model in wall-clock time) and, when installed, a
real vLLM with astro's scheduler plugin. Backends are looked up in `backends.ENGINE_BACKENDS`.

Heavy imports (FastAPI, uvicorn) live in the submodules; importing this package is cheap.
"""
