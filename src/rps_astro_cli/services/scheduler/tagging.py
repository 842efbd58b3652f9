"""Tagging a front-door request: its predicted output length and media facts, from the
tagger service (`POST /tag`, sent on the raw body as soon as it is read so it runs while
the scheduler parses) or an in-process `Tagger`, run on the worker thread
(`protocol.http_server.off_loop`): 0.5–4 ms of CPU per prompt (the hashed n-grams of up to
~4 KB of it), which on the event loop would stall every other request as long."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from rps_astro_cli.protocol.http_server import off_loop
from rps_astro_cli.protocol.service_wire import TagResult
from rps_astro_cli.services.rpc import RpcError
from rps_astro_cli.services.scheduler.clients import Clients, swallow
from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.settings import SchedulerSettings


class TagClient:
    """`start` the tag of a body, then `finish` it (counting `astro:tag_rpcs_total`)."""

    def __init__(self, settings: SchedulerSettings, clients: Clients, metrics: SchedulerMetrics):
        self.s = settings
        self.clients = clients
        self.m = metrics
        self._tagger = None
        # the tagger service's last failure (a late / failed RPC, or a failed health check;
        # None once it answers): the scheduler's /health shows it
        self.error: str | None = None
        if settings.tagger_url is None:
            from rps_astro_cli.services.tagger import Tagger, TaggerSettings

            self._tagger = Tagger(TaggerSettings(settings.length_model, settings.profile))

    def start(self, raw: bytes) -> asyncio.Future[tuple[int, bytes]] | None:
        """Send the tag RPC for `raw` now (None when tagging in-process)."""
        if self._tagger is not None:
            return None
        assert self.s.tagger_url is not None
        return asyncio.ensure_future(self.clients.post_json(self.s.tagger_url, "/tag", raw))

    def abandon(self, task: asyncio.Future[tuple[int, bytes]] | None) -> None:
        """Leave a started tag RPC to finish in the background (not cancelled: that
        keeps its keep-alive connection)."""
        if task is not None:
            task.add_done_callback(swallow)

    async def finish(self, task: asyncio.Future[tuple[int, bytes]] | None, raw: bytes) -> TagResult | None:
        """The tag, or None if it failed or missed `tag_deadline_s` (a late RPC is left to
        finish in the background)."""
        if task is None:  # in-process tagger
            return await off_loop(self._in_process, raw)
        done, _ = await asyncio.wait({task}, timeout=self.s.tag_deadline_s)
        if not done:
            task.add_done_callback(swallow)
            self.m.tag_rpcs.labels("timeout").inc()
            self.error = f"a /tag RPC missed its {self.s.tag_deadline_s * 1000:g} ms deadline"
            return None
        return self._result(task)

    def later(self, task: asyncio.Future[tuple[int, bytes]] | None, raw: bytes,
              on_tag: Callable[[TagResult | None], None]) -> None:
        """Call `on_tag` with the tag (None: it failed) once it is in, without waiting for
        it: for a request forwarded before its tag (`FrontDoor.route`'s late tag). The
        in-process tagger starts on the worker thread at the event loop's next turn, after
        the forward went out; an RPC ends within the clients' bound
        (`clients.RPC_BOUND_S`), no deadline."""
        if task is None:
            fut = asyncio.ensure_future(off_loop(self._in_process, raw))
            fut.add_done_callback(lambda t: on_tag(None if t.cancelled() else t.result()))
        else:
            task.add_done_callback(lambda t: on_tag(None if t.cancelled() else self._result(t)))

    def _in_process(self, raw: bytes) -> TagResult | None:
        """The in-process tagger's tag of `raw` (None: it failed; counted either way).
        Runs on the worker thread."""
        try:
            out = self._tagger.tag_result(json.loads(raw))  # type: ignore[union-attr]
        except Exception:
            self.m.tag_rpcs.labels("error").inc()
            return None
        self.m.tag_rpcs.labels("ok").inc()
        return out

    def _result(self, task: asyncio.Future[tuple[int, bytes]]) -> TagResult | None:
        """The finished tag RPC's tag (None: it failed; counted either way)."""
        try:
            status, body = task.result()
            if status != 200:
                if status >= 500 or status == 401:  # the tagger's fault (or a wrong token), not the body's
                    self.error = f"/tag answered HTTP {status}"
                raise ValueError(f"status {status}")
            tag = TagResult.from_dict(json.loads(body))
        except (TimeoutError, RpcError) as exc:
            self.m.tag_rpcs.labels("error").inc()
            self.error = f"/tag failed: {type(exc).__name__}: {exc}"[:200]
            return None
        except (ValueError, KeyError, TypeError):
            self.m.tag_rpcs.labels("error").inc()
            return None
        self.m.tag_rpcs.labels("ok").inc()
        self.error = None
        return tag

    async def check(self) -> None:
        """`GET /health` of the tagger service (1 s): sets or clears `error`."""
        if self.s.tagger_url is None:
            return
        try:
            code, _ = await self.clients.get(self.s.tagger_url, "/health")
            why = None if code == 200 else f"/health answered {code}"
        except Exception as exc:  # any transport failure: the tagger is not answering
            why = f"health check: {type(exc).__name__}"
        self.error = why
