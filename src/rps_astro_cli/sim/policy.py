"""The instance-policy interface.

A policy decides (a) the order in which waiting requests are considered for admission
each step and (b) which running request is preempted when KV blocks run out.

Contract used by `InstanceSim`, the look-ahead and the vLLM plugin:
- `order_waiting(waiting, now_s)` returns the waiting requests in admission order. The
  instance keeps the waiting queue as a list where preempted requests are put at the
  front (vLLM V1 `prepend_request`); FCFS keeps that list order as is.
- `preemption_victim(running, now_s)` names the running request to preempt (FCFS: the
  last one scheduled, vLLM V1's `running.pop()`).
- `time_dependent` is False when the order cannot change while time passes without new
  events (FCFS, static classes, EDF); the look-ahead uses it to skip re-sorting.
- Optional, for the Predictor's look-ahead (each a promise about the two methods above,
  for a given set of requests, tested per policy in tests/test_lookahead.py):
  `order_key` / `victim_key` (the order and the victim are sort keys: the look-ahead
  keeps its queue sorted and never asks), `order_groups` / `victim_groups` (a
  time-dependent order that is fixed inside groups: only group heads can come first,
  only each group's last can be the victim), and with the groups `order_merge_key`
  (the order is the merge of the groups by a key of their heads: the look-ahead
  evaluates it for the heads only), and with `victim_groups` `victim_merge_key` (the
  victim is the representative of the smallest key: the look-ahead never calls
  `preemption_victim`).
- Optional, waiting-side preemption (RPS-Serve's scheduler; off unless a policy sets
  `preempts_for_waiting`): when a waiting request's first chunk does not fit the free KV
  blocks, `InstanceSim` preempts `preemption_victim(running, now_s)` while
  `outranks(waiting_request, victim, now_s)` holds, then retries the admission. The
  Predictor's look-ahead models it too (it hands such steps to `InstanceSim.step`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from rps_astro_cli.params import Param, check_params
from rps_astro_cli.registry import Registry
from rps_astro_cli.sim.request import SimRequest

INSTANCE_POLICIES: Registry[type[InstancePolicy]] = Registry("instance policy")


class InstancePolicy:
    """Base class; subclasses register with `@INSTANCE_POLICIES.register(name)`."""

    name: str = "base"
    time_dependent: bool = False
    # the constructor's keyword parameters, declared (rps_astro_cli.params); make_policy
    # checks given values against them, and describe() reports them by these names
    params: ClassVar[tuple[Param, ...]] = ()
    # True: a waiting request that does not fit may preempt running requests it outranks
    # (module docstring)
    preempts_for_waiting: bool = False

    def outranks(self, waiting: SimRequest, running: SimRequest, now_s: float) -> bool:
        """Whether `waiting` has a strictly higher priority than `running` at `now_s`
        (only asked when `preempts_for_waiting`; the base policy: never)."""
        return False

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        """Waiting requests in admission order (first = admitted first)."""
        raise NotImplementedError

    def preemption_victim(self, running: Sequence[SimRequest], now_s: float) -> SimRequest:
        """The running request to preempt by recompute. `running` is non-empty."""
        raise NotImplementedError

    def order_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any] | None:
        """A sort key that gives this policy's waiting order for `requests`, or None.

        Contract (what the Predictor's look-ahead relies on to keep its queue sorted
        instead of asking for the order at every step): for every subset `ws` of
        `requests`, in any queue order, and every time `now_s`,
        `order_waiting(ws, now_s) == sorted(ws, key=key)` (a stable sort, so ties keep
        the queue order). None (the default) promises nothing.
        """
        return None

    def victim_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any] | None:
        """A key that names this policy's preemption victim among `requests`, or None.

        Contract (the look-ahead's, as for `order_key`): for every non-empty subset
        `running` of `requests`, in any order, and every time `now_s`,
        `preemption_victim(running, now_s)` is the `running[i]` with the largest
        `(key(running[i]), i)`. None (the default) promises nothing.
        """
        return None

    def order_groups(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], tuple[Any, Any]] | None:
        """For a time-dependent order: a function r → (group, key) such that, for every
        subset `ws` of `requests` and every time `now_s`, `order_waiting(ws, now_s)`
        lists the members of each group in stable key order (ties: queue order). The
        first request in the order is then always some group's head, which is all the
        look-ahead needs to know when nothing can be admitted. None promises nothing.
        """
        return None

    def order_merge_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest, float], Any] | None:
        """With `order_groups`: a function (r, now_s) → key such that, for every subset
        `ws` of `requests` (in any queue order) and every time `now_s`,
        `order_waiting(ws, now_s)` is the merge of the groups of `ws`, each in its group
        order, that takes next, each time, the remaining group head with the smallest
        (key(head, now_s), its group key, its queue position). The look-ahead then asks
        for the key of group heads only, instead of for the whole order at each step.
        None promises nothing.
        """
        return None

    def victim_groups(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], tuple[Any, Any]] | None:
        """For a time-dependent victim: a function r → (group, key) such that, for every
        non-empty subset `running` of `requests` and every time, the victim among
        `running` is the victim among its representatives: in each group the member
        with the largest (key, index), kept in running order. None promises nothing.
        """
        return None

    def victim_merge_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest, float], Any] | None:
        """With `victim_groups`: a function (r, now_s) → key such that, for every
        non-empty subset `running` of `requests` (in any order) and every time `now_s`,
        `preemption_victim(running, now_s)` is the representative (each group's member
        with the largest (group key, index), see `victim_groups`) with the smallest
        key(r, now_s), the latest in running order on equal keys. The look-ahead then
        evaluates the key of each representative instead of calling
        `preemption_victim`. None promises nothing.
        """
        return None

    def describe(self) -> dict[str, Any]:
        """Name and parameters, for `/status` and reports."""
        return {"name": self.name}


def make_policy(name: str, fields: Mapping[str, str] | None = None, **params: Any) -> InstancePolicy:
    """Instantiate a registered policy by name; `params` (strings from flags, typed
    values from code or JSON) are converted and checked against its declared `params`.

    Args:
        fields: parameter name → the flag / field it came from (for errors).

    Raises:
        AstroUserError: unknown name (the message lists the valid ones), an undeclared
            parameter (lists the declared ones), or a bad value (names the field).
    """
    cls = INSTANCE_POLICIES.get(name)
    return cls(**check_params(cls.params, params, owner=f"instance policy {name}", fields=fields))
