"""RPS-Serve's offline side and per-class bookkeeping (paper §3.2–3.5, DESIGN.md §3):
the workload profiler (`profiler`), the impact estimator (`estimator`), the request
classifier (`classifier`) and the queue manager's per-class metrics (`queue_metrics`).
The in-instance policies that use them live in `rps_astro_cli.policies.rps`."""
