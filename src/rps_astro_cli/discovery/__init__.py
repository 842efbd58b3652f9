"""Instance discovery: which engine instances exist now and which may take new requests.

- `instances`: `InstanceSet` (the merged view with added / ready / not_ready /
  terminating / removed events) and `DiscoveredInstance`; source-agnostic.
- `kubernetes`: a list + watch of a Service's EndpointSlices over the API server's HTTP
  API (httpx; no client library), in-cluster credentials.

Layering: depends on `errors` only (and httpx); the scheduler (services/) calls it.
"""

from rps_astro_cli.discovery.instances import DiscoveredInstance, InstanceEvent, InstanceSet

__all__ = ["DiscoveredInstance", "InstanceEvent", "InstanceSet"]
