"""The scheduler's connections: one pool per destination.

The hot path (tag, predict, forward) and the status polls of status-based policies run
on `services/rpc.py`'s lean keep-alive HTTP/1.1 pools (httpx costs ~20x more CPU per
call, see that module); health checks and model discovery use pooled
`httpx.AsyncClient`s.
"""

from __future__ import annotations

import asyncio

import httpx

from rps_astro_cli.services.rpc import HostPool

RPC_BOUND_S = 1.0  # longest a tag/predict RPC may run in the background after its deadline


class Clients:
    """Pooled clients by base URL. upstream_timeout_s: read timeout of the httpx ones.
    internal_token: the cluster's internal token, sent on every call (engines, Predictors
    and the tagger check it; `protocol.internal_auth`), or None."""

    def __init__(self, upstream_timeout_s: float, internal_token: str | None = None):
        from rps_astro_cli.protocol.internal_auth import token_headers

        self.upstream_timeout_s = upstream_timeout_s
        self.headers = token_headers(internal_token)
        self._http: dict[str, httpx.AsyncClient] = {}
        self._pools: dict[str, HostPool] = {}

    def http(self, base_url: str) -> httpx.AsyncClient:
        """The httpx client for one service (one pool per destination keeps httpx's
        per-request pool scan short and its connections warm)."""
        c = self._http.get(base_url)
        if c is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=60)
            c = self._http[base_url] = httpx.AsyncClient(
                base_url=base_url, limits=limits, timeout=httpx.Timeout(self.upstream_timeout_s, connect=2.0),
                headers=self.headers)
        return c

    def pool(self, base_url: str) -> HostPool:
        """The lean keep-alive pool for one service (hot path: tag, predict, forward)."""
        p = self._pools.get(base_url)
        if p is None:
            p = self._pools[base_url] = HostPool(base_url, headers=self.headers)
        return p

    async def post_json(self, base_url: str, path: str, payload: bytes) -> tuple[int, bytes]:
        """A JSON POST on the lean client: (status, body). The RPC may outlive its
        caller's deadline (bounded by RPC_BOUND_S): a late answer is ignored rather than
        cancelled, so its keep-alive connection is not torn down.

        Raises:
            RpcError: transport failure. TimeoutError: RPC_BOUND_S passed.
        """
        async with asyncio.timeout(RPC_BOUND_S):  # no extra task, unlike wait_for
            return await self.pool(base_url).post_json(path, payload)

    async def close(self) -> None:
        for c in self._http.values():
            await c.aclose()
        self._http.clear()
        for p in self._pools.values():
            p.close()
        self._pools.clear()


def swallow(t: asyncio.Future) -> None:
    """Done-callback of a task left to finish in the background: retrieve its exception
    so asyncio does not log it."""
    if not t.cancelled():
        t.exception()
