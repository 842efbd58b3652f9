"""The set of engine instances a discovery source currently knows, and its change events.

A discovery source (the Kubernetes EndpointSlice watch, `discovery/kubernetes.py`) feeds
an `InstanceSet` with what it reads; the scheduler reads `dispatchable()` and/or
subscribes to the events. The set is source-agnostic: entries arrive grouped by a
*source* (for Kubernetes one EndpointSlice; a Service's endpoints are spread over several
slices), and one instance may briefly sit in two sources while the control plane moves
it between slices. The merged view is conservative: an instance is ready only if every
source that lists it says ready, and terminating if any says terminating.

Each instance is in one of three phases:

    ready        — dispatchable: new requests may go there
    not_ready    — known, takes no new requests (starting, or failing its readiness probe)
    terminating  — going away: takes no new requests, its in-flight requests may finish

Events (`InstanceEvent.kind`), emitted after the set has changed, in this order within
one update: removals first, then additions, then phase changes:

    added        — a new instance (phase not_ready; a `ready` event follows at once if it
                   is already dispatchable)
    ready        — → ready
    not_ready    — ready → not_ready
    terminating  — ready or not_ready → terminating
    removed      — gone from every source (its in-flight requests are the consumer's)

An instance whose URLs change (same key, new address or port) is reported as removed and
added again. Callbacks run synchronously on the thread that applies the update (the
scheduler's event loop for the Kubernetes watch); an exception in a callback is logged
and does not stop the others or the source.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger("astro.discovery")

READY = "ready"
NOT_READY = "not_ready"
TERMINATING = "terminating"
ADDED = "added"
REMOVED = "removed"


@dataclass(frozen=True)
class DiscoveredInstance:
    """One engine instance as a discovery source reports it."""

    key: str  # stable identity: the pod's UID for Kubernetes (else its name, else its address)
    name: str  # label for headers and metrics: the pod name (else the address)
    engine_url: str  # base URL of its OpenAI-compatible engine, e.g. http://10.1.2.3:8000
    predictor_url: str | None  # base URL of its Predictor sidecar, or None (no predictions)
    ready: bool  # the source says it may receive traffic (EndpointSlice conditions.ready)
    terminating: bool  # the source says it is shutting down (conditions.terminating)
    node_name: str | None = None  # the node it runs on, when known (for logs only)

    @property
    def phase(self) -> str:
        """ready | not_ready | terminating (see the module docstring)."""
        if self.terminating:
            return TERMINATING
        return READY if self.ready else NOT_READY

    @property
    def dispatchable(self) -> bool:
        """May new requests go here: ready and not terminating."""
        return self.ready and not self.terminating


@dataclass(frozen=True)
class InstanceEvent:
    """One change of an `InstanceSet`."""

    kind: str  # added | ready | not_ready | terminating | removed
    instance: DiscoveredInstance  # the instance after the change (before it, for removed)


Listener = Callable[[InstanceEvent], None]


def _merge(copies: list[DiscoveredInstance]) -> DiscoveredInstance:
    """One view of an instance listed by several sources: ready only if all say ready,
    terminating if any says terminating; URLs and name from the first copy."""
    first = copies[0]
    if len(copies) == 1:
        return first
    ready = all(c.ready for c in copies)
    terminating = any(c.terminating for c in copies)
    return DiscoveredInstance(first.key, first.name, first.engine_url, first.predictor_url, ready, terminating,
                              first.node_name)


class InstanceSet:
    """The instances known now, grouped by source, with change events (module docstring).

    Not thread-safe: update and read it from one thread (the event loop).
    """

    def __init__(self, on_event: Listener | None = None):
        self._sources: dict[str, dict[str, DiscoveredInstance]] = {}  # source id → key → instance
        self._merged: dict[str, DiscoveredInstance] = {}  # key → merged view
        self._listeners: list[Listener] = [on_event] if on_event else []
        self.version = 0  # incremented on every update that changed something

    # -- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._merged)

    def __contains__(self, key: object) -> bool:
        return key in self._merged

    def get(self, key: str) -> DiscoveredInstance | None:
        """The merged view of instance `key`, or None."""
        return self._merged.get(key)

    def instances(self) -> tuple[DiscoveredInstance, ...]:
        """Every known instance (any phase), sorted by name then key."""
        return tuple(sorted(self._merged.values(), key=lambda i: (i.name, i.key)))

    def dispatchable(self) -> tuple[DiscoveredInstance, ...]:
        """The instances new requests may go to (ready, not terminating), sorted by name."""
        return tuple(i for i in self.instances() if i.dispatchable)

    def phases(self) -> dict[str, str]:
        """name → phase of every known instance (for logs, /instances and tests)."""
        return {i.name: i.phase for i in self.instances()}

    # -- listening -----------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener(event)` on every change from now on; returns an unsubscribe
        function."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # -- updating ------------------------------------------------------------------------
    def set_source(self, source: str, instances: Iterable[DiscoveredInstance]) -> list[InstanceEvent]:
        """Replace what `source` lists (e.g. one EndpointSlice after ADDED/MODIFIED)."""
        new = dict(self._sources)
        new[source] = {i.key: i for i in instances}
        return self._commit(new)

    def drop_source(self, source: str) -> list[InstanceEvent]:
        """Forget `source` (e.g. an EndpointSlice was DELETED)."""
        if source not in self._sources:
            return []
        new = dict(self._sources)
        del new[source]
        return self._commit(new)

    def reset(self, sources: Mapping[str, Iterable[DiscoveredInstance]]) -> list[InstanceEvent]:
        """Replace every source at once (after a full re-list): only real differences
        produce events, so a re-list of an unchanged fleet emits none."""
        return self._commit({s: {i.key: i for i in insts} for s, insts in sources.items()})

    def _commit(self, sources: dict[str, dict[str, DiscoveredInstance]]) -> list[InstanceEvent]:
        copies: dict[str, list[DiscoveredInstance]] = {}
        for source in sorted(sources):
            for key, inst in sources[source].items():
                copies.setdefault(key, []).append(inst)
        merged = {key: _merge(cs) for key, cs in copies.items()}
        old = self._merged
        removed: list[InstanceEvent] = []
        added: list[InstanceEvent] = []
        changed: list[InstanceEvent] = []
        for key, before in old.items():
            after = merged.get(key)
            if after is None or (after.engine_url, after.predictor_url) != (before.engine_url, before.predictor_url):
                removed.append(InstanceEvent(REMOVED, before))
        for key, after in merged.items():
            before = old.get(key)
            moved = before is not None and (after.engine_url, after.predictor_url) != (before.engine_url,
                                                                                     before.predictor_url)
            if before is None or moved:
                added.append(InstanceEvent(ADDED, after))
                if after.phase != NOT_READY:
                    changed.append(InstanceEvent(after.phase, after))
            elif after.phase != before.phase:
                changed.append(InstanceEvent(after.phase, after))
        self._sources = sources
        self._merged = merged
        events = removed + added + changed
        if events or merged != old:
            self.version += 1
        for ev in events:
            for listener in list(self._listeners):
                try:
                    listener(ev)
                except Exception:  # a consumer's bug must not stop discovery
                    log.exception("instance-set listener failed on %s %s", ev.kind, ev.instance.name)
        return events


__all__ = ["ADDED", "NOT_READY", "READY", "REMOVED", "TERMINATING", "DiscoveredInstance", "InstanceEvent",
           "InstanceSet"]
