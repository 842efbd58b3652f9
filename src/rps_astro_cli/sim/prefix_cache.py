"""vLLM V1 automatic prefix caching, for the instance model (`sim/instance.py`).

Facts kept from vLLM V1 (`vllm/v1/core/kv_cache_manager.py`, `block_pool.py`,
`kv_cache_utils.py`):

- Only *full* blocks are cached. A block is identified by a chained hash: the hash of
  (parent block's hash, the block's token ids), so equal hashes mean equal prefixes.
- A new (or preempted, back in the waiting queue) request looks up its longest run of
  cached leading blocks; the hit is capped so that at least one prompt token is
  computed (vLLM never counts the last token as cached: `max_cache_hit_length =
  num_tokens - 1`). The hit blocks are shared (reference counted), not copied.
- Blocks of a finished or preempted request whose reference count drops to 0 go back
  to the free queue *keeping their hash*: they still count as free, and a later request
  can hit them until they are reused. The free queue is LRU: allocation takes from its
  front, a freed request's blocks are appended to its back in reverse order (its tail
  blocks are evicted first), and taking a cached block from the front evicts it. A hit on
  a free cached block takes it out of the queue.
- Queries and hits are counted in tokens (`vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total`).

Simplifications (said here, not hidden): a block becomes cached when the step that
computes its last token ends (vLLM registers it when the step is scheduled, so a request
scheduled in the same step can share it one step earlier); when another request cached
the same hash first, this request's copy stays private (vLLM keeps both copies under the
hash); queries are counted once per admission, not per scheduling attempt.
Requests with no block hashes (length-only workloads) only ever take anonymous blocks,
so with no hashes anywhere the pool behaves exactly as a plain free-block counter.

Cache events (the sim engine's `/status?prefix_since=N`, for a dispatcher that needs
each instance's hit of a request before it picks candidates): with `track_events`, the
cache counts every change of its set of cached hashes (a block registered = stored, an
evicted one = removed; vLLM V1 publishes the same as KV events, BlockStored /
BlockRemoved) and keeps the latest hash per change. `delta(since)` answers the net
change since event `since` (hashes whose last change was a store / a removal) or, when
`since` is older than what is kept (or 0 on a fresh reader), the whole set; a
`PrefixMirror` applies these deltas and answers hit lengths as `lookup` does. Events are
small: a few hashes per engine step, not the whole table per poll.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0) -> tuple[int, ...]:
    """Chained hashes of the full blocks of `token_ids`: h_i = hash((h_{i-1}, block_i)),
    h_{-1} = `parent`. A trailing partial block has no hash. Python's hash of a tuple of
    ints is deterministic (no per-process salt), so hashes are stable across runs."""
    out: list[int] = []
    h = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start:start + block_size])))
        out.append(h)
    return tuple(out)


def events_delta(events: deque[tuple[int, int, bool]] | None, events_total: int, cached: Iterable[int],
                 since: int) -> dict[str, Any]:
    """`PrefixCache.delta`'s answer from a log of cache events (`events`: the latest
    (sequence number, hash, stored?) kept, None = not tracked; `events_total`: events so
    far; `cached`: the whole cached set now), for any keeper of such a log (the vLLM
    plugin's `engine.vllm_bridge.PrefixIndex` too)."""
    ev = events
    seq = events_total
    if ev is None or since <= 0 or since > seq or (seq > since and (not ev or ev[0][0] > since + 1)):
        return {"seq": seq, "reset": True, "stored": list(cached), "removed": []}
    last: dict[int, bool] = {}
    for n, h, stored in reversed(ev):
        if n <= since:
            break
        last.setdefault(h, stored)
    order = list(reversed(last.items()))  # oldest change first (a request's blocks in order)
    return {"seq": seq, "reset": False, "stored": [h for h, s in order if s],
            "removed": [h for h, s in order if not s]}


class _Run:
    """A run of anonymous (uncached) free blocks in the free queue; its value is the count."""

    __slots__ = ()


class PrefixCache:
    """The cached-block table and the free queue's order of one instance's KV pool.

    The instance keeps the free-block count (`InstanceSim.free_blocks`); this class keeps
    which free blocks are cached and in which order they are reused. Invariant: the
    instance's free_blocks == sum of anonymous run counts + cached hashes in the queue.
    """

    def __init__(self, num_blocks: int) -> None:
        # hash → number of requests holding the block (0 = free, cached, evictable)
        self.refs: dict[int, int] = {}
        # the free queue, front = next to reuse: _Run → count, or hash → 0
        self.queue: OrderedDict[object, int] = OrderedDict()
        self.queue[_Run()] = num_blocks
        self.num_blocks = num_blocks
        # hashes evicted so far (blocks reused while still cached)
        self.evictions_total = 0
        # cache events (module docstring): changes of the cached set so far, and the
        # latest `events_kept` of them as (sequence number, hash, stored?); None = off
        self.events_total = 0
        self.events: deque[tuple[int, int, bool]] | None = None

    def track_events(self, keep: int) -> None:
        """Start counting cache events, keeping the latest `keep` (≥ 1) for `delta`."""
        self.events = deque(maxlen=max(1, keep))

    def _event(self, h: int, stored: bool) -> None:
        self.events_total += 1
        if self.events is not None:
            self.events.append((self.events_total, h, stored))

    def delta(self, since: int) -> dict[str, Any]:
        """The cached set's change since event `since` (the wire form of `/status`'s
        `prefix_cache`): {"seq": events so far, "reset": bool, "stored": [hash...],
        "removed": [hash...]}. reset = true: `stored` is the whole set (`since` is 0,
        in the future, or older than the events kept) and the reader starts over."""
        return events_delta(self.events, self.events_total, self.refs, since)

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """(leading blocks of `hashes` cached, at most `max_blocks`; how many of those are
        free, i.e. would leave the free queue when taken)."""
        n = free = 0
        refs = self.refs
        while n < max_blocks and n < len(hashes):
            r = refs.get(hashes[n])
            if r is None:
                break
            if r == 0:
                free += 1
            n += 1
        return n, free

    def touch(self, hashes: Sequence[int]) -> None:
        """Take a reference on each cached hash (a hit); free ones leave the queue."""
        for h in hashes:
            r = self.refs[h]
            if r == 0:
                del self.queue[h]
            self.refs[h] = r + 1

    def take(self, n: int) -> None:
        """Reuse `n` free blocks from the queue's front, evicting cached ones met.
        The caller has checked that `n` ≤ the free count."""
        q = self.queue
        while n > 0:
            key, count = next(iter(q.items()))
            if isinstance(key, _Run):
                if count > n:
                    q[key] = count - n
                    return
                del q[key]
                n -= count
            else:
                del q[key]
                del self.refs[key]  # type: ignore[arg-type]
                self.evictions_total += 1
                self._event(key, False)  # type: ignore[arg-type]
                n -= 1

    def register(self, h: int) -> bool:
        """Cache a just-computed private block under `h` (held by its request). False when
        `h` is already cached (the block stays private)."""
        if h in self.refs:
            return False
        self.refs[h] = 1
        self._event(h, True)
        return True

    def release(self, anonymous: int, hashes: Sequence[int]) -> int:
        """A request gives back `anonymous` private blocks and its references to
        `hashes` (in block order). Appended to the queue's back tail-first: the private
        (tail) blocks, then the hashes last to first. Returns the blocks now free."""
        q = self.queue
        freed = 0
        if anonymous > 0:
            last = next(reversed(q), None) if q else None
            if isinstance(last, _Run):
                q[last] += anonymous
            else:
                q[_Run()] = anonymous
            freed = anonymous
        refs = self.refs
        for h in reversed(hashes):
            r = refs[h] - 1
            refs[h] = r
            if r == 0:
                q[h] = 0
                freed += 1
        return freed

    def reset(self) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`): only when no request
        holds a block (every block is in the free queue); False, changing nothing,
        otherwise. Each forgotten hash is a removal event, so a mirror follows."""
        free = sum(c for k, c in self.queue.items() if isinstance(k, _Run)) + self.num_cached_free
        if free != self.num_blocks:
            return False
        for h in list(self.refs):
            self._event(h, False)
        self.refs.clear()
        self.queue.clear()
        self.queue[_Run()] = self.num_blocks
        return True

    @property
    def num_cached_free(self) -> int:
        """Cached blocks sitting in the free queue (evictable)."""
        return sum(1 for k in self.queue if not isinstance(k, _Run))


class PrefixMirror:
    """A reader's copy of one instance's set of cached block hashes, kept by applying
    `PrefixCache.delta` payloads (module docstring). `seq` is what to ask `since` next."""

    def __init__(self) -> None:
        self.seq = 0  # the last event applied (0: none yet, the next answer is a reset)
        self.hashes: set[int] = set()  # cached block hashes as of event `seq`

    def apply(self, delta: Mapping[str, Any]) -> None:
        """Apply one `delta` payload.

        Raises:
            KeyError / TypeError / ValueError: a malformed payload (nothing is applied).
        """
        seq = int(delta["seq"])
        stored = [int(h) for h in delta["stored"]]
        removed = [int(h) for h in delta.get("removed", ())]
        if not delta.get("reset") and seq < self.seq:
            return  # an older answer overtaken by a newer one: already covered
        if delta.get("reset"):
            self.hashes = set(stored)
        else:
            self.hashes.difference_update(removed)
            self.hashes.update(stored)
        self.seq = seq

    def hit_blocks(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Leading blocks of `hashes` in the set, at most `max_blocks` (as `PrefixCache.
        lookup`)."""
        n = 0
        have = self.hashes
        while n < max_blocks and n < len(hashes) and hashes[n] in have:
            n += 1
        return n
