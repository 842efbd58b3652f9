"""astro (`rps_astro_cli`): Astrolabe dispatch + RPS-Serve in-instance scheduling, with a
vLLM-faithful instance simulator shared by the Predictor, the sim engine and the
virtual-time cluster simulation (see ARCHITECTURE.md at the repository root)."""

__version__ = "0.1.0"
