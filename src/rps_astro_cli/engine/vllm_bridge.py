"""The vllm-free half of astro's vLLM scheduler plugin: request views, policy ordering,
the status snapshot and its transport. `engine/vllm_plugin.py` (the only module that
imports vllm) wires these into vLLM V1's `Scheduler`; everything here works on duck-typed
objects, so it is unit-tested without vllm.

Pieces:

- `RequestView`: what an `InstancePolicy` reads from a request (the attributes of
  `sim.request.SimRequest`), taken from a vLLM V1 `Request`:
  `arrival_time` → `arrival_s` (wall clock, `time.time()` seconds), `num_prompt_tokens` →
  `prompt_tokens`, live `num_computed_tokens` / `num_output_tokens`
  (→ `num_generated_tokens`), `mm_features` → `modality` / `vision_tokens` (each feature's
  `mm_position.length` placeholder tokens; modality "video" if any video item, else
  "image"), and from `sampling_params.extra_args` (what a client sends as `vllm_xargs`):
  `astro_predicted_output_tokens`, `astro_class` (sand / pebbles / rocks),
  `astro_deadline_s` (absolute, engine clock) or `astro_slo_s` (relative to arrival).
  A view is made once per request and cached on the request object.
- `PolicyDriver`: each step, the waiting queue in the policy's `order_waiting` order, and
  preemption ranks from repeated `preemption_victim` calls (only when the step could run
  out of KV blocks: see `preemption_possible`).
- `StatusBoard`: an immutable per-step capture of running/waiting requests and KV blocks
  (tuples of ints, cheap to build in the scheduler thread), turned into the
  `status.InstanceStatus` JSON only when asked.
- `StatusSocketServer`: serves the latest capture over a Unix-domain socket in a daemon
  thread (connect → one JSON document → close); `status_middleware` is the ASGI
  middleware (`--middleware rps_astro_cli.engine.vllm_bridge.status_middleware`) that
  answers `GET /status` on vLLM's own API server from that socket, so a vLLM instance shows
  the Predictor the same surface as a sim engine (`/v1`, `/health`, `/metrics`,
  `/status`) without a proxy.

Environment (set by `engine.vllm_launch`): `ASTRO_VLLM_POLICY` (policy name, default
fcfs), `ASTRO_VLLM_POLICY_PARAMS` (JSON object of policy parameters),
`ASTRO_VLLM_STATUS_SOCKET` (socket path; unset = no status export), `ASTRO_VLLM_INSTANCE_ID`,
`ASTRO_VLLM_PROFILE_ID`, `ASTRO_VLLM_POLICY_MODULES` (comma-separated modules imported
before the policy is looked up, so they can register user-defined policies),
`ASTRO_VLLM_STEP_LOG` (CSV path: one line per engine step with its batch shape and
duration, for `profiling.vllm_calibrate`; unset = no log).
"""

from __future__ import annotations

import json
import math
import os
import socket
import socketserver
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.prefix_cache import block_hashes, events_delta
from rps_astro_cli.types import InstanceConfig, InstanceStatus, RequestStatus

ENV_POLICY = "ASTRO_VLLM_POLICY"
ENV_POLICY_PARAMS = "ASTRO_VLLM_POLICY_PARAMS"
ENV_STATUS_SOCKET = "ASTRO_VLLM_STATUS_SOCKET"
ENV_INSTANCE_ID = "ASTRO_VLLM_INSTANCE_ID"
ENV_PROFILE_ID = "ASTRO_VLLM_PROFILE_ID"
ENV_POLICY_MODULES = "ASTRO_VLLM_POLICY_MODULES"
ENV_STEP_LOG = "ASTRO_VLLM_STEP_LOG"

XARG_PREDICTED = "astro_predicted_output_tokens"
XARG_CLASS = "astro_class"
XARG_DEADLINE = "astro_deadline_s"
XARG_SLO = "astro_slo_s"
_CLASSES = ("sand", "pebbles", "rocks")


def _opt_int(v: Any) -> int | None:
    try:
        i = int(v)
    except (TypeError, ValueError):
        return None
    return i if i >= 1 else None


def _opt_float(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class RequestView:
    """A vLLM request seen through `SimRequest`'s attribute names (see module docstring).

    Static facts are read once; `num_computed_tokens`, `num_generated_tokens` and
    `num_preemptions` read the live request. Unknown / malformed `extra_args` values are
    ignored (None), never raised: a client cannot break the engine through them.
    """

    __slots__ = ("req", "request_id", "arrival_s", "prompt_tokens", "modality", "vision_tokens",
                 "encoder_s", "req_class", "predicted_output_tokens", "deadline_s",
                 "target_output_tokens", "first_scheduled_s", "first_token_s", "finish_s")

    def __init__(self, req: Any):
        self.req = req
        self.request_id: str = req.request_id
        self.arrival_s: float = float(req.arrival_time)
        self.prompt_tokens: int = int(req.num_prompt_tokens)
        vision = 0
        modality = "text"
        for f in getattr(req, "mm_features", None) or ():
            pos = getattr(f, "mm_position", None)
            vision += int(getattr(pos, "length", 0) or 0)
            m = str(getattr(f, "modality", "image"))
            if m == "video":
                modality = "video"
            elif modality == "text":
                modality = "image"
        self.vision_tokens = vision
        self.modality = modality
        self.encoder_s = 0.0
        sp = getattr(req, "sampling_params", None)
        xargs = getattr(sp, "extra_args", None) or {}
        self.predicted_output_tokens = _opt_int(xargs.get(XARG_PREDICTED))
        cls = xargs.get(XARG_CLASS)
        self.req_class = cls if cls in _CLASSES else None
        deadline = _opt_float(xargs.get(XARG_DEADLINE))
        if deadline is None:
            slo = _opt_float(xargs.get(XARG_SLO))
            deadline = None if slo is None else self.arrival_s + slo
        self.deadline_s = deadline
        max_tokens = _opt_int(getattr(req, "max_tokens", None))
        self.target_output_tokens = self.predicted_output_tokens or max_tokens or 1
        self.first_scheduled_s = None
        self.first_token_s = None
        self.finish_s = None

    @property
    def num_computed_tokens(self) -> int:
        return self.req.num_computed_tokens

    @property
    def num_generated_tokens(self) -> int:
        return self.req.num_output_tokens

    @property
    def num_preemptions(self) -> int:
        return getattr(self.req, "num_preemptions", 0)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.req.num_output_tokens

    @property
    def is_prefilling(self) -> bool:
        n = self.num_tokens
        return n - self.req.num_computed_tokens > 1 or self.req.num_output_tokens == 0

    @property
    def kv_blocks(self) -> int:  # filled in by the status capture; policies rarely read it
        return 0


def view_of(req: Any) -> RequestView:
    """The cached `RequestView` of a vLLM request (made on first use, stored on it)."""
    v = getattr(req, "_astro_view", None)
    if v is None:
        v = RequestView(req)
        req._astro_view = v
    return v


def policy_from_env(environ: dict[str, str] | None = None) -> InstancePolicy:
    """The instance policy named by `ASTRO_VLLM_POLICY` (default fcfs) with the JSON
    parameters in `ASTRO_VLLM_POLICY_PARAMS`, for the profile `ASTRO_VLLM_PROFILE_ID`
    (when set), built by `policies.build.build_instance_policy` as on every other path.

    Raises:
        AstroUserError: a policy module that does not import, unknown policy name,
            parameters that are not a JSON object, or
            parameters the policy rejects, or an unknown profile.
    """
    env = os.environ if environ is None else environ
    for mod in filter(None, (m.strip() for m in env.get(ENV_POLICY_MODULES, "").split(","))):
        import importlib

        try:
            importlib.import_module(mod)
        except ImportError as exc:
            raise AstroUserError(f"cannot import {mod!r}: {exc}", field=ENV_POLICY_MODULES) from None
    name = env.get(ENV_POLICY, "fcfs") or "fcfs"
    raw = env.get(ENV_POLICY_PARAMS, "") or "{}"
    try:
        params = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise AstroUserError(f"not valid JSON ({exc.msg})", field=ENV_POLICY_PARAMS) from None
    if not isinstance(params, dict):
        raise AstroUserError("must be a JSON object", field=ENV_POLICY_PARAMS)
    from rps_astro_cli.policies import INSTANCE_POLICIES

    INSTANCE_POLICIES.get(name)  # unknown name: the error lists the valid ones
    from rps_astro_cli.policies.build import build_instance_policy, resolve_profile

    # the engine's profile ties the policy to it as on every other path (rps: its classifier; edf: its E2E)
    profile = resolve_profile(env.get(ENV_PROFILE_ID, "") or None, field=ENV_PROFILE_ID)
    try:
        return build_instance_policy(name, params, profile)  # checked against the policy's declared parameters
    except (TypeError, AstroUserError) as exc:
        raise AstroUserError(f"policy {name!r} rejects its parameters: {exc}",
                             field=ENV_POLICY_PARAMS) from None


class PolicyDriver:
    """Applies an `InstancePolicy` to vLLM's queues.

    `reorders_waiting` / `picks_victims` are False for FCFS, whose order and victim
    (the last running request) are vLLM's own, so the plugin then does no work per step.
    For a policy whose order does not change while time passes (`time_dependent` False:
    static_class, edf, naive_class), a queue that is still the tail of the last order it
    produced (only admissions since) is left as is without calling the policy.
    `max_ranked_victims`: how many victims `rank_victims` orders by the policy (the rest
    tie, and vLLM then takes the latest arrival first); more than a few preemptions in
    one step are rare, and ranking all n costs O(n²) policy calls.
    """

    def __init__(self, policy: InstancePolicy, max_ranked_victims: int = 4):
        self.policy = policy
        fcfs = isinstance(policy, FCFSPolicy)
        self.reorders_waiting = not fcfs
        self.picks_victims = not fcfs
        self.max_ranked_victims = max_ranked_victims
        self.num_reorders = 0  # steps whose waiting order differed from vLLM's
        self._last_order: list[Any] | None = None

    def order_waiting(self, queue: Any, now_s: float) -> bool:
        """Rewrite `queue` (a deque-like FCFS queue of vLLM requests: iterable, `clear`,
        `extend`) in the policy's admission order. Returns True when the order changed."""
        if not self.reorders_waiting or len(queue) < 2:
            return False
        last = self._last_order
        if last is not None and not self.policy.time_dependent:
            k = len(last) - len(queue)
            if k >= 0 and all(a is b for a, b in zip(queue, last[k:])):
                return False
        reqs = list(queue)
        ordered = self.policy.order_waiting([view_of(r) for r in reqs], now_s)
        new = [v.req for v in ordered]
        if len(new) != len(reqs):
            raise RuntimeError(f"policy {self.policy.name!r} returned {len(new)} of {len(reqs)} waiting requests")
        self._last_order = new
        if all(a is b for a, b in zip(new, reqs)):
            return False
        queue.clear()
        queue.extend(new)
        self.num_reorders += 1
        return True

    def victim_order(self, running: Sequence[Any], now_s: float, limit: int | None = None) -> list[Any]:
        """Running requests in the order the policy would preempt them (first = first
        victim): repeated `preemption_victim` on the shrinking set, as the sim instance
        does when it preempts several requests in one step; at most `limit` of them
        (None = all). O(limit · n) policy work."""
        views = [view_of(r) for r in running]
        out = []
        while views and (limit is None or len(out) < limit):
            v = self.policy.preemption_victim(views, now_s)
            views.remove(v)
            out.append(v.req)
        return out

    def rank_victims(self, running: Sequence[Any], now_s: float) -> None:
        """Set `request.priority` of the first `max_ranked_victims` victims to their rank
        (first victim = highest; the others 0), which vLLM's priority-mode preemption (`max` by
        `(priority, arrival_time)`) then follows. Only the running set's priorities are
        touched; vLLM's waiting queue stays FCFS (the plugin orders it itself)."""
        order = self.victim_order(running, now_s, self.max_ranked_victims)
        for r in running:
            r.priority = 0
        n = len(order)
        for i, r in enumerate(order):
            r.priority = n - i


def preemption_possible(running: Iterable[Any], free_blocks: int, block_size: int) -> bool:
    """False when this step cannot run out of KV blocks: every running request's
    remaining tokens (`num_tokens_with_spec - num_computed_tokens`, an upper bound on what
    it can be scheduled, plus async-scheduling output placeholders) plus one lookahead
    block fit in `free_blocks` together."""
    need = 0
    for r in running:
        left = (r.num_tokens_with_spec + getattr(r, "num_output_placeholders", 0)
                - r.num_computed_tokens)
        need += -(-left // block_size) + 1
        if need > free_blocks:
            return True
    return False


# A captured request: (request_id, num_computed_tokens, generated tokens, view) — the
# view supplies the static astro fields.
_Cap = tuple


def capture_requests(reqs: Iterable[Any]) -> tuple[_Cap, ...]:
    """Immutable capture of `reqs` (vLLM requests) for the status board."""
    return tuple(
        (r.request_id, r.num_computed_tokens, r.num_output_tokens, view_of(r)) for r in reqs
    )


class PrefixIndex:
    """vLLM's prefix cache in astro's block hashes, kept from vLLM V1's own KV cache events.

    vLLM's block pool, with KV cache events on, reports each full block it caches
    (`BlockStored`: vLLM's hashes of consecutive blocks, the parent block's hash, the
    blocks' token ids) and each one it evicts (`BlockRemoved`), and a reset
    (`AllBlocksCleared`). Here each stored block gets astro's chained hash
    (`sim.prefix_cache.block_hashes` of its token ids, chained from the parent's astro
    hash; 0 for a first block), the hash the scheduler computes for a prompt, so the
    scheduler's `PrefixMirror` reads a vLLM instance as it reads a sim engine
    (`delta(since)`: `/status?prefix_since=N`'s `prefix_cache`). vLLM can hold two
    blocks under one hash (it does not de-duplicate); a hash leaves the set when its last
    copy is evicted. Events are matched by class name (duck-typed: no vllm import);
    partial blocks and KV cache groups other than 0 are ignored. Thread-safe: events are
    applied by the scheduler thread, read by the status socket's.
    """

    def __init__(self, block_size: int, keep: int = 4096):
        self.block_size = block_size  # tokens per KV block (vLLM's block size)
        self._astro: dict[Any, int] = {}  # vLLM hash of a cached block → its astro hash
        self._copies: dict[Any, int] = {}  # vLLM hash → cached blocks under it
        self._events: deque[tuple[int, int, bool]] = deque(maxlen=max(1, keep))  # (seq, astro hash, stored?)
        self.events_total = 0  # changes of the cached set so far
        self._lock = threading.Lock()

    def _event(self, h: int, stored: bool) -> None:
        self.events_total += 1
        self._events.append((self.events_total, h, stored))

    def apply(self, events: Iterable[Any]) -> None:
        """Apply a batch of vLLM KV cache events, in order."""
        with self._lock:
            for ev in events:
                kind = type(ev).__name__
                if getattr(ev, "group_idx", None) not in (None, 0):
                    continue
                if kind == "BlockStored":
                    self._stored(list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids))
                elif kind == "BlockRemoved":
                    for vh in ev.block_hashes:
                        self._removed(vh)
                elif kind == "AllBlocksCleared":
                    for h in self._astro.values():
                        self._event(h, False)
                    self._astro.clear()
                    self._copies.clear()

    def _stored(self, vhashes: list[Any], parent: Any, token_ids: list[int]) -> None:
        bs = self.block_size
        if not vhashes or len(token_ids) != len(vhashes) * bs:
            return  # a partial block (or an empty event): never a prefix hit for astro
        if parent is None:
            ah_parent = 0
        elif parent in self._astro:
            ah_parent = self._astro[parent]
        else:
            return  # the parent is not cached: a chain astro cannot name
        for vh, ah in zip(vhashes, block_hashes(token_ids, bs, ah_parent), strict=True):
            n = self._copies.get(vh, 0)
            self._copies[vh] = n + 1
            if n == 0:
                self._astro[vh] = ah
                self._event(ah, True)

    def _removed(self, vh: Any) -> None:
        n = self._copies.get(vh, 0)
        if n > 1:
            self._copies[vh] = n - 1
        elif n == 1:
            del self._copies[vh]
            self._event(self._astro.pop(vh), False)

    def __len__(self) -> int:
        return len(self._astro)

    def delta(self, since: int) -> dict[str, Any]:
        """The cached set's change since event `since`, in `PrefixCache.delta`'s form."""
        with self._lock:
            return events_delta(self._events, self.events_total, list(self._astro.values()), since)


class StatusBoard:
    """The latest status capture, written by the scheduler thread, read by the socket
    thread (one reference swap; no lock needed).

    `limits`: the instance's `InstanceConfig`; `policy`: the policy's `describe()` (kept
    stable: the Predictor caches policies by it); `plugin`: a live dict of counters
    shown as `/status` `plugin`.
    """

    def __init__(self, instance_id: str, limits: InstanceConfig, policy: dict[str, Any],
                 profile_id: str = "", plugin: dict[str, Any] | None = None, prefix: PrefixIndex | None = None):
        self.prefix = prefix  # vLLM's prefix cache in astro's hashes (None: prefix caching off)
        self.instance_id = instance_id
        self.plugin = plugin if plugin is not None else {}
        self.limits = limits
        self.policy = policy
        self.profile_id = profile_id
        self._cap: tuple = (time.time(), (), (), limits.num_gpu_blocks, 0)
        # the latest steps (batch size, new tokens, decode context tokens, prefill pairs,
        # encoder s, duration s), for the Predictor's online calibration (`steps_since`)
        self._steps: deque[tuple[int, int, int, float, float, float]] = deque(maxlen=STEP_ROWS)
        self.steps_logged = 0

    def add_step(self, shape: tuple[int, int, int, float], duration_s: float) -> None:
        """One finished engine step (`step_shape` and its measured duration, s)."""
        self._steps.append((shape[0], shape[1], shape[2], shape[3], 0.0, duration_s))
        self.steps_logged += 1

    def steps_since(self, seq: int) -> dict[str, Any]:
        """The steps after step number `seq` still kept: {"seq": steps in all, "rows":
        [...]}, as the sim engine's `/status?steps_since=N` (`sim.calibration`)."""
        rows = list(self._steps)  # one C-level copy: the scheduler thread may append meanwhile
        seq_now = self.steps_logged
        n = seq_now - max(0, seq)
        return {"seq": seq_now, "rows": [list(r) for r in rows[-n:]] if n > 0 else []}

    def publish(self, running: Iterable[Any], waiting: Iterable[Any], kv_blocks_free: int,
                num_preemptions_total: int, now_s: float | None = None) -> None:
        """Capture the current state (called by the scheduler each step)."""
        self._cap = (time.time() if now_s is None else now_s, capture_requests(running),
                     capture_requests(waiting), kv_blocks_free, num_preemptions_total)

    def snapshot(self) -> InstanceStatus:
        """The latest capture as an `InstanceStatus`."""
        t, run, wait, free, npre = self._cap
        bs = self.limits.block_size

        def rs(c: _Cap, running: bool) -> RequestStatus:
            rid, computed, generated, v = c
            return RequestStatus(
                request_id=rid, arrival_s=v.arrival_s, prompt_tokens=v.prompt_tokens,
                num_computed_tokens=computed, generated_tokens=generated,
                predicted_output_tokens=v.predicted_output_tokens, modality=v.modality,
                vision_tokens=v.vision_tokens, encoder_s=0.0, req_class=v.req_class,
                kv_blocks=-(-computed // bs) if running else 0, deadline_s=v.deadline_s,
            )

        waiting = tuple(rs(c, False) for c in wait)
        classes: dict[str, Any] = {}
        for w in waiting:
            if w.req_class is None:
                continue
            c = classes.setdefault(w.req_class, {"queue_len": 0, "mean_wait_s": 0.0})
            c["queue_len"] += 1
            c["mean_wait_s"] += max(0.0, t - w.arrival_s)
        for c in classes.values():
            c["mean_wait_s"] /= c["queue_len"]
        return InstanceStatus(
            instance_id=self.instance_id, time_s=t, limits=self.limits, kv_blocks_free=free,
            running=tuple(rs(c, True) for c in run), waiting=waiting, policy=self.policy,
            profile_id=self.profile_id, num_preemptions_total=npre, classes=classes,
        )

    def to_json(self, prefix_since: int | None = None, steps_since: int | None = None) -> bytes:
        """The `/status` body: `InstanceStatus.to_dict()` plus a top-level `plugin` object
        (the plugin's own counters; readers of the schema ignore it) and, when
        `prefix_since` is given and prefix caching is on, `prefix_cache`: the change of the
        set of cached block hashes since event `prefix_since` (`PrefixIndex.delta`, the
        sim engine's `?prefix_since=N`); with `steps_since`, `steps` (`steps_since`)."""
        d = self.snapshot().to_dict()
        d["plugin"] = dict(self.plugin)
        if prefix_since is not None and self.prefix is not None:
            d["prefix_cache"] = self.prefix.delta(prefix_since)
        if steps_since is not None:
            d["steps"] = self.steps_since(steps_since)
        return json.dumps(d, separators=(",", ":")).encode()


STEP_ROWS = 4096  # steps a status board keeps for its Predictor's calibration


def _query_since(line: bytes, key: bytes = b"prefix_since") -> int | None:
    """`key`'s value in a status socket query line (`b"prefix_since=N&steps_since=M"`),
    or None."""
    for part in line.strip().split(b"&"):
        k, _, val = part.partition(b"=")
        if k == key:
            try:
                return int(val)
            except ValueError:
                return None
    return None


def status_query(prefix_since: int | None = None, steps_since: int | None = None) -> bytes:
    """The status socket's query line for these parameters (b"\\n" for none)."""
    parts = [b"%s=%d" % (k, v) for k, v in ((b"prefix_since", prefix_since), (b"steps_since", steps_since))
             if v is not None]
    return b"&".join(parts) + b"\n"


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:  # one query line in (may be empty), one JSON document out
        line = b""
        try:
            self.request.settimeout(1.0)
            while b"\n" not in line and len(line) < 256:
                chunk = self.request.recv(256)
                if not chunk:
                    break
                line += chunk
        except OSError:  # a client that sends nothing (an older reader) gets the plain status
            pass
        try:
            body = self.server.board.to_json(  # type: ignore[attr-defined]
                _query_since(line), _query_since(line, b"steps_since"))
        except Exception as exc:  # never kill the engine for a status bug
            body = json.dumps({"error": {"message": f"status snapshot failed: {exc!r}",
                                         "type": "InternalServerError", "code": 500}}).encode()
        self.request.sendall(body)


class StatusSocketServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Serves `board` on the Unix socket `path` from a daemon thread (`start()`)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, path: str, board: StatusBoard):
        if os.path.exists(path):
            os.unlink(path)
        super().__init__(path, _Handler)
        self.board = board
        self.path = path

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="astro-status", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def read_status_socket(path: str, timeout_s: float = 2.0, prefix_since: int | None = None) -> dict[str, Any]:
    """Fetch one snapshot from a status socket (blocking client, for tools and tests);
    `prefix_since` as `/status?prefix_since=N`.

    Raises:
        OSError: the socket is absent or the engine did not answer in `timeout_s`.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(status_query(prefix_since))
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    return json.loads(b"".join(chunks))


_TOKEN_GUARD: list[Any] = []  # [InternalAuth | None], built on the first request


def _token_guard() -> Any:
    """The internal-token check of this process ($ASTRO_INTERNAL_TOKEN / _FILE), or None."""
    if not _TOKEN_GUARD:
        from rps_astro_cli.protocol.internal_auth import InternalAuth, internal_token

        token = internal_token()
        _TOKEN_GUARD.append(InternalAuth(None, token) if token else None)
    return _TOKEN_GUARD[0]


async def status_middleware(request, call_next):
    """ASGI HTTP middleware for vLLM's API server: `GET /status` → the engine core's
    snapshot from `$ASTRO_VLLM_STATUS_SOCKET`; `GET /ready` → 200 once the engine core
    publishes it (503 before, naming why), as the sim engine's /ready; every other path
    passes through. With an internal token in the environment
    (`protocol.internal_auth`), every path but /health and /ready needs it (401 else),
    /v1 included, so only the cluster's scheduler and Predictor reach the engine.

    `GET /status?prefix_since=N` adds `prefix_cache` (`StatusBoard.to_json`), as the sim
    engine's.

    Errors: 405 for another method on /status; 400 for a `prefix_since` that is not an
    integer; 503 JSON when the engine core has not published yet (socket absent) or does
    not answer within 2 s.
    """
    from starlette.responses import JSONResponse, Response

    from rps_astro_cli.protocol.internal_auth import OPEN_PATHS, unauthorized

    path = request.url.path
    guard = _token_guard()
    if guard is not None and path not in OPEN_PATHS and not guard.allowed(request.headers.raw):
        body, headers = unauthorized()
        return Response(body, status_code=401, headers={k.decode(): v.decode() for k, v in headers
                                                        if k != b"content-length"})
    if path not in ("/status", "/ready"):
        return await call_next(request)
    import asyncio

    if request.method not in ("GET", "HEAD"):
        return JSONResponse({"error": {"message": f"use GET {path}", "type": "BadRequestError",
                                       "param": "method", "code": 405}}, status_code=405)
    asked: dict[str, int | None] = {"prefix_since": None, "steps_since": None}
    for name in asked:
        since = request.query_params.get(name) if path == "/status" else None
        if since is not None:
            try:
                asked[name] = int(since)
            except ValueError:
                what = "a cache event number; 0 = the whole set" if name == "prefix_since" else "a step number"
                return JSONResponse({"error": {"message": f"{name}: must be an integer ({what}), got {since!r}",
                                               "type": "BadRequestError", "param": name, "code": 400}},
                                    status_code=400)
    query = status_query(asked["prefix_since"], asked["steps_since"])
    sock = os.environ.get(ENV_STATUS_SOCKET, "")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(sock), 2.0)
        try:
            writer.write(query)
            await asyncio.wait_for(writer.drain(), 2.0)
            body = await asyncio.wait_for(reader.read(-1), 2.0)
        finally:
            writer.close()
    except (TimeoutError, OSError) as exc:
        why = f"engine status unavailable ({type(exc).__name__}); the engine core may still be starting"
        if path == "/ready":
            return JSONResponse({"ready": False, "reason": why}, status_code=503)
        return JSONResponse({"error": {"message": why, "type": "ServiceUnavailableError", "param": None,
                                       "code": 503}}, status_code=503)
    if path == "/ready":
        return JSONResponse({"ready": True})
    return Response(body, media_type="application/json")


def step_shape(items: Iterable[tuple[int, int, int, int]]) -> tuple[int, int, int, float]:
    """Batch shape of one step in `LatencyModel.step_s` terms, from
    (new tokens n, computed tokens before the step k, sequence tokens, generated tokens)
    per scheduled request: (batch_size, num_tokens, decode_ctx_tokens, prefill_pairs).
    A request is a decode when n = 1, it has generated ≥ 1 token and the sequence is
    computed up to its last token (adds k + 1 context tokens); otherwise its chunk adds
    c·k + c(c+1)/2 attention pairs — the same split `InstanceSim.step` uses."""
    b = t = ctx = 0
    pairs = 0.0
    for n, k, seq, gen in items:
        b += 1
        t += n
        if n == 1 and gen > 0 and seq - k == 1:
            ctx += k + 1
        else:
            pairs += n * k + n * (n + 1) / 2
    return b, t, ctx, pairs


class StepLog:
    """Append-only CSV of engine steps: `batch_size,num_tokens,decode_ctx_tokens,
    prefill_pairs,step_s` (header written when the file is new). Buffered; flushed at
    most every `flush_s` seconds and on `close()`."""

    HEADER = "batch_size,num_tokens,decode_ctx_tokens,prefill_pairs,step_s\n"

    def __init__(self, path: str, flush_s: float = 0.5):
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self._fh = open(path, "a", buffering=1 << 16)
        if new:
            self._fh.write(self.HEADER)
        self._flush_s = flush_s
        self._last = time.monotonic()

    def add(self, shape: tuple[int, int, int, float], step_s: float) -> None:
        b, t, ctx, pairs = shape
        self._fh.write(f"{b},{t},{ctx},{pairs:.0f},{step_s:.7f}\n")
        now = time.monotonic()
        if now - self._last > self._flush_s:
            self._fh.flush()
            self._last = now

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError:
            pass
