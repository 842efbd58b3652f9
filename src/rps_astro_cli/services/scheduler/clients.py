"""The scheduler's connections: one pool per destination.

Every call (tag, predict, forward, status polls, health checks, model discovery) runs
on `services/rpc.py`'s lean keep-alive HTTP/1.1 pools: httpx costs ~20x more CPU per
call (see that module), and the health checks on httpx were ~9 % of a loaded
scheduler's CPU.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rps_astro_cli.services.rpc import HostPool

RPC_BOUND_S = 1.0  # longest a tag/predict RPC may run in the background after its deadline


class Clients:
    """Pooled clients by base URL. upstream_timeout_s: the forward's upstream timeout.
    internal_token: the cluster's internal token, sent on every call (engines, Predictors
    and the tagger check it; `protocol.internal_auth`), or None."""

    def __init__(self, upstream_timeout_s: float, internal_token: str | None = None):
        from rps_astro_cli.protocol.internal_auth import token_headers

        self.upstream_timeout_s = upstream_timeout_s
        self.headers = token_headers(internal_token)
        self._pools: dict[str, HostPool] = {}

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

    async def get(self, base_url: str, path: str, timeout_s: float = 1.0) -> tuple[int, bytes]:
        """A GET on the lean client (health checks): (status, whole body) within
        `timeout_s`; a cancelled or timed-out call drops its connection.

        Raises:
            RpcError: transport failure. TimeoutError: `timeout_s` passed.
        """
        async with asyncio.timeout(timeout_s):
            resp = await self.pool(base_url).request("GET", path)
            try:
                return resp.status, await resp.read()
            finally:
                resp.aclose_sync()

    async def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()


def swallow(t: asyncio.Future[Any]) -> None:
    """Done-callback of a task left to finish in the background: retrieve its exception
    so asyncio does not log it."""
    if not t.cancelled():
        t.exception()
