"""Wire protocols shared by the engines, the services and the profiler: `openai` parses
and validates OpenAI-compatible request bodies (pure functions, no server framework)."""
