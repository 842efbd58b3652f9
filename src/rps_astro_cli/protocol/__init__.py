"""Wire protocols shared by the engines, the services and the profiler: `openai` parses
and validates OpenAI-compatible request bodies (pure functions, no server framework), with
its value types in `openai_types`, media URL checks and pricing in `media` and vLLM's
request rules in `vllm_rules`; `service_wire` holds the `/predict` and `/tag` bodies;
`limits`, `http_server` and `internal_auth` bound and serve the HTTP side."""
