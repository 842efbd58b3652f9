"""Astrolabe's services as processes on loopback: Predictor sidecars, the length tagger,
the global scheduler (OpenAI front door), and the cluster supervisor behind `astro serve`.
Each service module has `create_app(settings)` (FastAPI) and a blocking `run_*`."""
