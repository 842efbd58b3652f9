"""The RPS-Serve family of in-instance policies (paper §3.4–3.6 and its baselines, §4.1;
ARCHITECTURE.md §3). Pure Python: the sim engine, the Predictor's look-ahead and the vLLM
plugin run this same code.

Registered names (`make_policy(name, **params)`):

| name | waiting order (first = admitted first) | preemption victim |
| --- | --- | --- |
| `edf` | earliest deadline; deadline = `deadline_s` if set, else arrival + `slo_scale` × isolated E2E | latest deadline |
| `naive_class` | class by modality (text → sand → image → pebbles → video → rocks), FCFS inside | heaviest class, latest scheduled |
| `static_class` | class by the smart classifier, sand → pebbles → rocks, FCFS inside | heaviest class, latest scheduled |
| `naive_aging` | age only (oldest first), class-blind | youngest |
| `rps` | smart classifier + priority regulator: lowest `−log P_c(w)` first | worst score, never sand while a heavier request runs |

Class of a request (class-aware policies except `naive_class`), in this order:
1. `SimRequest.req_class` when it is one of sand / pebbles / rocks (set by the engine, a
   client, or an earlier step of this policy);
2. else the smart classifier (`classifier=` an artifact name under `artifacts/rps/`, a
   folder path, or a `RequestClassifier`) applied to (prompt tokens, vision tokens,
   modality) through its impact estimator;
3. else the naive class of the modality (when no classifier is configured).
The resolved class is written back to `req_class` once, so `/status`, the bench
report and the look-ahead see the class the policy used.

Ties always fall back to arrival time, then queue position (FCFS inside a class; a
preempted request, which vLLM puts at the queue front, wins ties).

Waiting-side preemption (`rps` with `preempt_waiting=true`): the RPS-Serve authors'
scheduler keeps running and waiting requests in one list sorted by priority (age counted
from arrival for both), and a waiting request whose KV blocks do not fit preempts the
lowest-priority running request while that one's priority is lower
(github.com/muse-research-lab/rps-serve, rps-serve-changes.patch: scheduler.py's waiting
loop). With the flag off
(the default, as before) a waiting request never preempts: preemption happens only when
a running request cannot grow (vLLM V1's own rule). The Predictor's look-ahead predicts
with it as the engine runs it.
"""  # noqa: E501  (the table rows)

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, ClassVar, cast

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.params import Param
from rps_astro_cli.policies.priority import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_STATIC,
    PriorityRegulator,
)
from rps_astro_cli.rps.classes import CLASS_RANK, CLASSES, naive_class
from rps_astro_cli.sim.policy import INSTANCE_POLICIES, InstancePolicy
from rps_astro_cli.sim.request import SimRequest

_GET_CLASS = attrgetter("req_class")
_GET_ARRIVAL = attrgetter("arrival_s")


def _load_classifier(classifier: Any) -> Any:
    """None → None; a name/path → the loaded `RequestClassifier`; an object with
    `classify(prompt_tokens, vision_tokens, modality)` → itself."""
    if classifier is None or classifier == "" or classifier == "naive":
        return None
    if isinstance(classifier, (str, Path)):
        from rps_astro_cli.rps.classifier import load_classifier

        return load_classifier(classifier)
    if not callable(getattr(classifier, "classify", None)):
        raise AstroUserError(
            f"expected an artifact name, a folder or a classifier object, got {classifier!r}",
            field="classifier",
        )
    return classifier


CLASSIFIER = Param("classifier", object, None, "smart classifier: an artifact name under artifacts/rps/, a "
                   "folder, or 'naive' / null for the classes by modality")


def _regulator_values(key: str) -> Callable[[Any], list[float]]:
    """A `Param.parse` that checks one regulator parameter with the regulator's own rules."""
    def parse(value: Any) -> list[float]:
        return PriorityRegulator(**{key: value}).describe()[key]

    return parse


STATIC_PRIORITY = Param("static_priority", object, list(DEFAULT_STATIC), "S per class (sand, pebbles, rocks; "
                        "or a mapping by class), ≥ 0", parse=_regulator_values("static_priority"))
ALPHA = Param("alpha", object, list(DEFAULT_ALPHA), "α per class (sand, pebbles, rocks), > 0",
              parse=_regulator_values("alpha"))
BETA = Param("beta", object, list(DEFAULT_BETA), "β per class (sand, pebbles, rocks), > 0, in s^−α",
             parse=_regulator_values("beta"))
SLO_SCALE = Param("slo_scale", float, 5.0, "deadline = arrival + slo_scale × isolated E2E", gt=0)
PREEMPT_WAITING = Param("preempt_waiting", bool, False, "a waiting request that does not fit preempts running "
                        "requests of lower priority P (the RPS-Serve authors' scheduler); false = vLLM's rule "
                        "(only a running request that cannot grow preempts)")
PROFILE = Param("profile", object, None, "execution profile id / JSON path for the isolated E2E (default: the "
                "shipped default profile; the sim engine passes its own)")


class ClassAwarePolicy(InstancePolicy):
    """Base of the class-aware policies: resolves and caches each request's class
    (see the module docstring for the order)."""

    params: ClassVar[tuple[Param, ...]] = (CLASSIFIER,)

    def __init__(self, classifier: Any = None):
        self.classifier = _load_classifier(classifier)
        self._classifier_name = (
            str(classifier) if isinstance(classifier, (str, Path)) and self.classifier
            else getattr(self.classifier, "name", None) or ("naive" if self.classifier is None else "custom")
        )

    def classify(self, req: SimRequest) -> str:
        """The request's class (sand / pebbles / rocks); labels `req.req_class`."""
        c = req.req_class
        if c is None or c not in CLASS_RANK:
            if self.classifier is not None:
                c = self.classifier.classify(req.prompt_tokens, req.vision_tokens, req.modality)
            else:
                c = naive_class(req.modality)
            req.req_class = c
        return c

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "classifier": self._classifier_name}


class _StaticOrder(ClassAwarePolicy):
    """Static class priority: sand → pebbles → rocks, FCFS inside each class."""

    time_dependent = False

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        keyed = [(CLASS_RANK[self.classify(r)], r.arrival_s, i) for i, r in enumerate(waiting)]
        keyed.sort()
        return [waiting[k[2]] for k in keyed]

    def order_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any]:
        """(class rank, arrival): the order above, for any set of requests."""
        return lambda r: (CLASS_RANK[self.classify(r)], r.arrival_s)

    def victim_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any]:
        """Class rank: the victim above (heaviest class, latest scheduled)."""
        return lambda r: CLASS_RANK[self.classify(r)]

    def preemption_victim(self, running: Sequence[SimRequest], now_s: float) -> SimRequest:
        best = max(range(len(running)), key=lambda i: (CLASS_RANK[self.classify(running[i])], i))
        return running[best]


@INSTANCE_POLICIES.register("static_class")
class StaticClassPolicy(_StaticOrder):
    """Smart classifier with static priorities (RPS-Serve's "Smart Classifier" ablation,
    §3.4): sand → pebbles → rocks, FCFS inside each class; victim = a request of the
    heaviest running class, the latest scheduled among them.

    Args:
        classifier: artifact name / folder / classifier object; None → naive fallback.
    """

    name = "static_class"


@INSTANCE_POLICIES.register("naive_class")
class NaiveClassPolicy(_StaticOrder):
    """Naive classifier with static priorities (RPS-Serve's "Naive Classifier" baseline,
    §3.4): class by modality only, sand → pebbles → rocks, FCFS inside each class. It
    ignores any `req_class` already set (it is the by-modality baseline)."""

    name = "naive_class"
    params = ()

    def __init__(self) -> None:
        super().__init__(classifier=None)

    def classify(self, req: SimRequest) -> str:
        c = naive_class(req.modality)
        if req.req_class is None:
            req.req_class = c
        return c

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


@INSTANCE_POLICIES.register("naive_aging")
class NaiveAgingPolicy(InstancePolicy):
    """Naive aging (RPS-Serve's ablation baseline, §3.6): priority grows with age only,
    class-blind. Any priority that increases with waiting time orders requests oldest
    first, so the waiting order is arrival order (ties: queue position) and the victim is
    the youngest running request. It differs from `fcfs` only for preempted requests:
    fcfs keeps vLLM's queue order and preempts the request scheduled last."""

    name = "naive_aging"
    time_dependent = False

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        keyed = sorted((r.arrival_s, i) for i, r in enumerate(waiting))
        return [waiting[i] for _, i in keyed]

    def order_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any]:
        """Arrival time: the order above, for any set of requests."""
        return _GET_ARRIVAL

    def victim_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any]:
        """Arrival time: the youngest is the victim (latest scheduled on ties)."""
        return _GET_ARRIVAL

    def preemption_victim(self, running: Sequence[SimRequest], now_s: float) -> SimRequest:
        return running[max(range(len(running)), key=lambda i: (running[i].arrival_s, i))]


@INSTANCE_POLICIES.register("rps")
class RPSPolicy(ClassAwarePolicy):
    """RPS-Serve (§3.6): smart classes + priority regulator, re-evaluated every step.

    Waiting order: highest `P_c(w)` first, i.e. lowest `score = −log P_c(w)`, where
    `w = now_s − arrival_s` (s); ties by arrival then queue position.
    Victim: among running requests heavier than sand (all of them if only sand runs),
    the worst score (lowest P); on ties (P saturates at S + 1 for long waits) the
    youngest, then the latest scheduled — so sand is never preempted while a pebble or
    rock runs. With one class only, both rules reduce (P grows with the
    wait) to arrival order and the youngest victim, which is how they are computed then
    (`order_key` / `victim_key` give them to the look-ahead).

    Args:
        classifier: artifact name / folder / classifier object; None → naive fallback.
        static_priority, alpha, beta: regulator parameters (3 values sand / pebbles /
            rocks, or a mapping by class); defaults from the paper (see
            `policies/priority.py`).
        preempt_waiting: waiting-side preemption (module docstring); `outranks` is
            P_waiting(w) > P_running(w), each at its own wait since arrival.
    """

    name = "rps"
    time_dependent = True
    params = (CLASSIFIER, STATIC_PRIORITY, ALPHA, BETA, PREEMPT_WAITING)

    def __init__(
        self,
        classifier: Any = None,
        static_priority: Sequence[float] | Mapping[str, float] = DEFAULT_STATIC,
        alpha: Sequence[float] | Mapping[str, float] = DEFAULT_ALPHA,
        beta: Sequence[float] | Mapping[str, float] = DEFAULT_BETA,
        preempt_waiting: bool = False,
    ):
        super().__init__(classifier)
        self.regulator = PriorityRegulator(static_priority, alpha, beta)
        self.preempts_for_waiting = bool(preempt_waiting)
        #: class → (S + 1, −β, α): `neg_priority`'s constants (the regulator's P, same operations)
        self._consts = {c: (q.static + 1.0, -q.beta, q.alpha) for c, q in self.regulator.params.items()}
        #: the same by class rank
        self._rank_consts = [self._consts[c] for c in CLASSES]

    def score(self, req: SimRequest, now_s: float) -> float:
        """The request's scheduling score −log P_c(w) at `now_s` (lower runs first)."""
        return self.regulator.score(self.classify(req), now_s - req.arrival_s)

    def outranks(self, waiting: SimRequest, running: SimRequest, now_s: float) -> bool:
        """P_c(w) of `waiting` > P_c(w) of `running`, each at its own wait since arrival."""
        self.classify(waiting)
        self.classify(running)
        return self.neg_priority(waiting, now_s) < self.neg_priority(running, now_s)

    def neg_priority(self, req: SimRequest, now_s: float) -> float:
        """−P_c(w) of a classified request at `now_s` (lower runs first): the key of the
        waiting order, and the look-ahead's `order_merge_key`. The regulator's
        `priority` with the same floating-point operations (tests compare them bit for
        bit), one function for both so that the look-ahead orders exactly as the engine."""
        k = self._consts.get(req.req_class)  # type: ignore[arg-type]
        s1, nb, a = k if k is not None else self._consts[self.classify(req)]
        w = now_s - req.arrival_s
        return math.exp(nb * (w if w > 0.0 else 0.0) ** a) - s1

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        """Each class oldest first (ties: queue order), merged by taking next the class
        head with the highest P_c(w), ties by arrival, then queue position. As P grows
        with the wait inside a class this is the sort by (−P, arrival, position); it is
        defined as the merge so that "oldest first inside a class" (`order_groups`) holds
        exactly, whatever the rounding of P."""
        n = len(waiting)
        if n <= 1:
            return list(waiting)
        rank = CLASS_RANK
        got = list(map(rank.get, map(_GET_CLASS, waiting)))
        ks: list[int] = cast(list[int], got)
        if None in got:  # unlabelled: classify once (labels them)
            ks = [k if k is not None else rank[self.classify(waiting[i])] for i, k in enumerate(got)]
        if ks.count(ks[0]) == n:
            # one class: P_c(w) grows with the wait, so the order is oldest first (by
            # definition here, rather than up to float rounding of P), at any time
            return sorted(waiting, key=_GET_ARRIVAL)
        # −P per request: `neg_priority` inlined (the same operations; tests compare the
        # two bit for bit); sorted by (−P, arrival, position) as two stable sorts
        consts, exp = self._rank_consts, math.exp
        arrs = list(map(_GET_ARRIVAL, waiting))
        negp: list[float] = []
        for i in range(n):
            s1, nb, a = consts[ks[i]]
            w = now_s - arrs[i]
            negp.append(exp(nb * (w if w > 0.0 else 0.0) ** a) - s1)
        order = sorted(range(n), key=arrs.__getitem__)
        order.sort(key=negp.__getitem__)
        # the merge equals that sort when each class comes out oldest first in it (P is
        # monotone in the wait); a rounding step of P against the wait would break that
        last_a, last_i = [-math.inf] * 3, [-1] * 3
        for i in order:
            c = ks[i]
            arr, la = arrs[i], last_a[c]
            if arr < la or (arr == la and i < last_i[c]):
                order = _merge_classes([(negp[j], arrs[j], j) for j in range(n)], ks)
                break
            last_a[c] = arr
            last_i[c] = i
        return [waiting[i] for i in order]

    def order_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any] | None:
        """Arrival time when all `requests` are of one class (then `order_waiting` is
        oldest first at any time, see there); None when classes mix (the order changes
        as requests age)."""
        it = iter(requests)
        first = next(it, None)
        if first is None:
            return _GET_ARRIVAL
        c0 = self.classify(first)
        classify = self.classify
        for r in it:
            if classify(r) != c0:
                return None
        return _GET_ARRIVAL

    def class_and_arrival(self, req: SimRequest) -> tuple[str, float]:
        """(class, arrival s) of a request: its `order_groups` and `victim_groups` value."""
        return self.classify(req), req.arrival_s

    def order_groups(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], tuple[Any, Any]]:
        """(class, arrival): inside a class the order is oldest first, queue order on
        ties (`order_waiting` merges the classes; tests/test_lookahead.py checks the
        contract)."""
        return self.class_and_arrival

    def order_merge_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest, float], Any]:
        """`neg_priority`: `order_waiting` merges the classes by the heads' (−P, arrival,
        queue position)."""
        return self.neg_priority

    def victim_groups(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], tuple[Any, Any]]:
        """(class, arrival): in a class the lowest P_c(w) is the youngest (latest
        scheduled on ties), so the victim is among each class's youngest."""
        return self.class_and_arrival

    def victim_merge_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest, float], Any]:
        """`victim_rank`: among each class's youngest, `preemption_victim` takes the
        smallest (sand last, P_c(w), −arrival), the latest scheduled on ties."""
        return self.victim_rank

    def victim_rank(self, req: SimRequest, now_s: float) -> tuple[bool, float, float]:
        """(is sand, P_c(w), −arrival) of a classified request at `now_s`: the
        `victim_merge_key` (the smallest is preempted first). P with the regulator's
        `priority` operations (S + 1 − exp(−β w^α), negative waits as 0), bit for bit."""
        c = req.req_class
        k = self._consts.get(c)  # type: ignore[arg-type]
        if k is None:
            c = self.classify(req)
            k = self._consts[c]
        s1, nb, a = k
        w = now_s - req.arrival_s
        return c == "sand", s1 - math.exp(nb * (w if w > 0.0 else 0.0) ** a), -req.arrival_s

    def victim_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any] | None:
        """Arrival time when all `requests` are of one class (the victim is then the
        youngest, see `preemption_victim`); None when classes mix."""
        return self.order_key(requests)

    def preemption_victim(self, running: Sequence[SimRequest], now_s: float) -> SimRequest:
        n = len(running)
        first = self.classify(running[0])
        if all(self.classify(r) == first for r in running):
            # one class: the lowest P_c(w) is the shortest wait, so the youngest, latest
            # scheduled on ties (by definition here, rather than up to float rounding)
            return running[max(range(n), key=lambda i: (running[i].arrival_s, i))]
        pool = [i for i, r in enumerate(running) if self.classify(r) != "sand"] or range(n)
        pr = self.regulator.priority
        best = min(pool, key=lambda i: (pr(cast(str, running[i].req_class), now_s - running[i].arrival_s),
                                        -running[i].arrival_s, -i))
        return running[best]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.regulator.describe(),
                **({"preempt_waiting": True} if self.preempts_for_waiting else {})}


def _merge_classes(keyed: list[tuple[float, float, int]], ks: list[int]) -> list[int]:
    """The positions of `keyed` ((−P, arrival, position) per request; `ks[position]` its
    class rank) in the merge of the classes, each oldest first (ties: position), that
    takes next the class head of the smallest key."""
    by_class: list[list[tuple[float, float, int]]] = [[], [], []]
    for k in sorted(keyed, key=lambda k: (k[1], k[2])):
        by_class[ks[k[2]]].append(k)
    return [k[2] for k in heapq.merge(*by_class)]


@INSTANCE_POLICIES.register("edf")
class EDFPolicy(InstancePolicy):
    """Earliest deadline first (RPS-Serve's EDF baseline, §4.1).

    deadline = `req.deadline_s` when set; else arrival + `slo_scale` × the request's
    isolated E2E (`rps.estimator.isolated_latency` on `profile`, with the request's
    encoder time and output length = `predicted_output_tokens`, else
    `target_output_tokens` — the sim engine's true length, i.e. EDF is given the
    deadline, as the paper's EDF assumes). The computed deadline is written to
    `req.deadline_s` once. Victim: the latest deadline (latest scheduled on ties).

    Args:
        slo_scale: SLO multiple of the isolated E2E (> 0; the paper uses 5).
        profile: execution-profile id / JSON path / `ExecutionProfile` for the isolated
            E2E; default the shipped default profile.

    Raises:
        AstroUserError: slo_scale ≤ 0, or an unknown profile.
    """

    name = "edf"
    time_dependent = False
    params = (SLO_SCALE, PROFILE)

    def __init__(self, slo_scale: float = 5.0, profile: Any = None):
        from rps_astro_cli.sim.latency import LatencyModel
        from rps_astro_cli.sim.profile import ExecutionProfile, load_profile

        if not slo_scale > 0:
            raise AstroUserError(f"must be > 0, got {slo_scale}", field="slo_scale")
        self.slo_scale = float(slo_scale)
        prof = profile if isinstance(profile, ExecutionProfile) else load_profile(profile)
        self.profile_id = prof.profile_id
        self.latency = LatencyModel(prof)

    def deadline(self, req: SimRequest) -> float:
        """The request's deadline (s, engine clock); sets `req.deadline_s` if unset."""
        d = req.deadline_s
        if d is None:
            from rps_astro_cli.rps.estimator import isolated_latency

            out = req.predicted_output_tokens or req.target_output_tokens
            iso = isolated_latency(self.latency, max(1, req.prompt_tokens), max(1, out), req.encoder_s)
            d = req.arrival_s + self.slo_scale * iso.e2e_s
            req.deadline_s = d
        return d

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        keyed = [(self.deadline(r), r.arrival_s, i) for i, r in enumerate(waiting)]
        keyed.sort()
        return [waiting[k[2]] for k in keyed]

    def order_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any]:
        """(deadline, arrival): the order above, for any set of requests."""
        return lambda r: (self.deadline(r), r.arrival_s)

    def victim_key(self, requests: Sequence[SimRequest]) -> Callable[[SimRequest], Any]:
        """Deadline: the latest deadline is the victim (latest scheduled on ties)."""
        return self.deadline

    def preemption_victim(self, running: Sequence[SimRequest], now_s: float) -> SimRequest:
        return running[max(range(len(running)), key=lambda i: (self.deadline(running[i]), i))]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "slo_scale": self.slo_scale, "profile": self.profile_id}


# -- tying a policy to an engine's execution profile ----------------------------------------
def profile_policy_params(name: str, profile: Any) -> dict[str, Any]:
    """Default constructor arguments that tie policy `name` to an engine's execution
    profile (an `ExecutionProfile`): `edf` gets the profile (its isolated E2E);
    `static_class` and `rps` get the classifier artifact `artifacts/rps/<profile_id>/`
    when one is shipped (else they fall back to the naive classes, see the module
    docstring). Other policies: {}."""
    if name == "edf":
        return {"profile": profile}
    if name in ("static_class", "rps"):
        from rps_astro_cli.rps.classifier import list_classifiers

        pid = getattr(profile, "profile_id", None)
        if pid and pid in list_classifiers():
            return {"classifier": pid}
    return {}
