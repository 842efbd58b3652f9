"""Virtual-time cluster simulation: N simulated instances + a dispatch policy, driven by
a list of timed requests (ARCHITECTURE.md §1 use 3)."""

from rps_astro_cli.cluster.virtual import ClusterRecord, ClusterResult, simulate_cluster
from rps_astro_cli.cluster.workload import TimedRequest, poisson_workload, read_length_trace

__all__ = ["ClusterRecord", "ClusterResult", "TimedRequest", "poisson_workload", "read_length_trace",
           "simulate_cluster"]
