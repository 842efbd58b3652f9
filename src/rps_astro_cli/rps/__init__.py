"""RPS-Serve's model of a request (paper §3.3–3.5, ARCHITECTURE.md "RPS-Serve"): the
sand / pebbles / rocks classes (`classes`), the impact estimator (`estimator`), the request
classifier (`classifier`), the queue manager's per-class metrics (`queue_metrics`) and the
profile rows they are fitted on (`records`). The in-instance policies that use them live
in `rps_astro_cli.policies.rps`; measuring and fitting live in `rps_astro_cli.profiling`."""
