"""Memory strategies: how a KV pool's backing follows the pages a serving engine uses.

Every strategy drives a real :class:`~kvvmm.owner.KvBufferOwner` (on whatever driver the
runner was given: sim, host, cuda) through one small interface, :class:`Strategy`:

- :meth:`Strategy.prepare`: before CUDA-graph capture (slot 0's page is already backed);
- :meth:`Strategy.start`: after capture, before the first request;
- :meth:`Strategy.update`: at a step boundary, with the pages the engine just handed out
  (they must be backed before the next step runs) and those it just took back.

Driver time spent in ``update`` stalls the decode path; the runner measures it. The shipped
strategies:

- :class:`Static`: the whole pool backed before capture (what ``cudaMalloc`` gives);
- :class:`PostCaptureFinalize`: slot 0 before capture, ``finalize`` to the budget after it
  (the seed's, and SGLang's, flow);
- :class:`PrefixGrowth`: ``ensure_prefix`` to the engine's high-water page under a growth
  policy, optionally giving the tail back (``shrink``) with hysteresis.

- :class:`PageElastic`: map and unmap pages anywhere as slots come and go
  (``commit_pages``/``decommit_pages``, kvcached's model), optionally over a
  :class:`~kvvmm.arena.pool.HandlePool` that keeps the handles a decommit gives back, so a
  decommit-then-commit cycle costs unmap + map instead of release + create;
  ``layout="interleaved"`` runs it over one buffer of all layers (``xl-page-elastic``):
  a granule is one mapping, not ``2 x layers``.
- :class:`RequestRanges` (0.3): the engine's pages come from a
  :class:`~kvvmm.owner.RangeBacking` (one contiguous lease per request, one handle per
  fresh range, on the interleaved layout); ``deferred=True`` keeps released blocks mapped
  for reuse and a reserve mapped ahead, given back above a watermark, with that upkeep off
  the decode path (the runner charges it to a backing thread's clock, and a step waits only
  for a commit it needs that has not finished).

A strategy of your own is a subclass that sets ``name`` and overrides ``update``; the
helpers :meth:`Strategy.grow_to` and :meth:`Strategy.shrink_to` keep :attr:`covered_pages`
(pages ``[0, covered_pages)`` are backed in every buffer) in step with the owner.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence

from kvvmm.arena.pool import HandlePool
from kvvmm.checks import bool_arg, int_arg, number_arg
from kvvmm.driver.base import Driver
from kvvmm.errors import ArgumentError
from kvvmm.owner import KvBufferOwner, Lease, RangeBacking
from kvvmm.policy import GrowthPolicy, default_policy
from kvvmm.workload.serving import SlotAllocator

__all__ = ["ADMIT_WAIT_S", "MAX_ADMIT_WAIT_S", "STRATEGIES", "LeaseAllocator", "PageElastic",
           "PostCaptureFinalize", "PrefixGrowth", "RequestRanges", "Static", "Strategy",
           "make_strategy"]


class Strategy:
    """Base of memory strategies; a subclass overrides :meth:`update` (and maybe others).

    The runner calls :meth:`bind` with the owner it built (using :attr:`policy` as the
    owner's growth policy), then ``prepare()``, ``start()``, and ``update(...)`` at step
    boundaries.
    """

    name: str = "strategy"
    #: the growth policy the owner is built with (None: the owner's default)
    policy: GrowthPolicy | None = None
    #: the buffers' layout the runner builds the owner with (``kvvmm.layout.LAYOUTS``)
    layout: str = "token_major"
    #: serving time of the boundary :meth:`update` is called at (the runner sets it first),
    #: seconds: for strategies that decide by time, not by steps
    now_s: float = 0.0

    def make_pool(self, driver: Driver) -> HandlePool | None:
        """The handle pool the owner's arena draws from (None: none), made on ``driver``.

        Called once, before the owner is built; the runner closes the pool after the owner.
        """
        return None

    def bind(self, owner: KvBufferOwner, *, pool_pages: int) -> None:
        """Attach to ``owner`` (whose ``reserved_tokens`` is ``pool_pages * page_size``)."""
        self.owner = owner
        self.page_size = owner.page_size
        self.pool_pages = pool_pages
        self.changes = 0  #: owner calls that changed the backing
        self.refresh()

    def refresh(self) -> int:
        """Re-read :attr:`covered_pages` from the owner (after anything changed it)."""
        ps = self.page_size
        covered = self.pool_pages
        for b, d in zip(self.owner.snapshot().buffers, self.owner.descs, strict=True):
            covered = min(covered, (b.backed_bytes // d.row_bytes) * d.tokens_per_row // ps)
        self.covered_pages = covered
        return covered

    def make_allocator(self, executor: Callable[[Callable[[], None], bool], None]
                       ) -> SlotAllocator | None:
        """The engine's page allocator (None: the serving model's own), made after
        :meth:`bind`. ``executor(job, waited)`` runs driver work off the decode path (the
        runner's: it charges the work to a backing thread's clock)."""
        return None

    def close(self) -> None:
        """After serving, before the owner closes: stop what the strategy started."""

    def prepare(self) -> None:
        """Before CUDA-graph capture: slot 0's page is backed. Default: nothing more."""

    def start(self) -> None:
        """After capture, before serving. Default: nothing."""

    def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
        """Back every page in ``allocated`` (they are used from the next step on).

        Args:
            allocated: pages just handed out to requests.
            freed: pages just given back by finished or preempted requests.
            high_water: one past the highest page in use now.
        """
        raise NotImplementedError(f"{type(self).__name__} must define update()")

    # -- helpers ---------------------------------------------------------------------------

    def grow_to(self, pages: int) -> int:
        """Back pages ``[0, pages)`` of every buffer (``ensure_prefix``); bytes newly backed."""
        added = self.owner.ensure_prefix(min(pages, self.pool_pages) * self.page_size)
        if added:
            self.changes += 1
        self.refresh()
        return added

    def shrink_to(self, pages: int) -> int:
        """Give back what lies beyond pages ``[0, pages)`` (whole mappings); bytes given back."""
        keep = max(pages, 2)  # shrink(n) keeps n tokens and the padded page: two pages at least
        given = self.owner.shrink((keep - 1) * self.page_size)
        if given:
            self.changes += 1
        self.refresh()
        return given

    def finalize_pool(self) -> int:
        """Back the whole pool (``finalize`` to ``pool_pages``); bytes newly backed."""
        added = self.owner.finalize((self.pool_pages - 1) * self.page_size)
        if added:
            self.changes += 1
        self.refresh()
        return added

    def __str__(self) -> str:
        return self.name


class Static(Strategy):
    """The whole pool backed before capture, never given back (what ``cudaMalloc`` gives)."""

    name = "static"

    def prepare(self) -> None:
        self.finalize_pool()

    def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
        pass  # everything is backed


class PostCaptureFinalize(Strategy):
    """Slot 0 before capture, ``finalize`` to the budget after it (the seed's flow)."""

    name = "finalize"

    def start(self) -> None:
        self.finalize_pool()

    def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
        pass  # finalize backed the whole budget


class PrefixGrowth(Strategy):
    """``ensure_prefix`` to the high-water page; optionally shrink the tail, with hysteresis.

    Args:
        policy: the owner's growth policy (default :func:`~kvvmm.policy.default_policy`).
        shrink: give back the tail when the pool has emptied enough.
        hysteresis: the pool counts as "low" while the backed pages exceed ``(1 + hysteresis)
            * high_water + min_slack_pages`` (> 0); a shrink goes down to ``(1 + hysteresis /
            2)`` times the highest high water of the last ``hold_s`` seconds.
        min_slack_pages: pages beyond the need never worth a shrink, >= 0 (default: one
            granule of the first buffer: less than that a shrink cannot give back).
        hold_s: shrink only once the pool has stayed low for this many seconds of serving
            time (>= 0; default 5). Without it the pool emptying for one step between two
            bursts gave everything back and the next burst grew it again: the hour's trace
            paid hundreds of shrink-and-regrow cycles on the decode path.
    """

    def __init__(self, policy: GrowthPolicy | None = None, *, shrink: bool = False,
                 hysteresis: float = 1.0, min_slack_pages: int | None = None,
                 hold_s: float = 5.0) -> None:
        hyst = number_arg("hysteresis", hysteresis, lo=0, lo_open=True, finite=False,
                          limit="a number > 0")
        if min_slack_pages is not None:
            int_arg("min_slack_pages", min_slack_pages, lo=0, unit="pages")
        hold = number_arg("hold_s", hold_s, lo=0, finite=False,  # inf: the pool never shrinks
                          limit="a number >= 0 (seconds of serving time)")
        self.policy = default_policy() if policy is None else policy
        self.shrink = shrink
        self.hysteresis = hyst
        self.hold_s = hold
        self._min_slack = min_slack_pages
        self.min_slack_pages = 0 if min_slack_pages is None else min_slack_pages
        self.name = "prefix+shrink" if shrink else "prefix"
        # After a shrink that gave nothing back (a handle straddles the target), retry only
        # when the backing changed or the target halved: each try costs a snapshot.
        self._stuck_at = -1
        self._retry_below = 0
        self._low_since: float | None = None  # serving time the pool became low
        # (time, high water) of the last hold_s seconds, high waters decreasing: its head is
        # the window's peak, what a shrink must keep
        self._recent: deque[tuple[float, int]] = deque()

    def bind(self, owner: KvBufferOwner, *, pool_pages: int) -> None:
        super().bind(owner, pool_pages=pool_pages)
        if self._min_slack is None:
            d = owner.descs[0]
            page_bytes = d.row_bytes * owner.page_size // d.tokens_per_row
            self.min_slack_pages = max(1, owner.arena.granularity // page_bytes)

    def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
        if high_water > self.covered_pages:
            self.grow_to(high_water)
            self._stuck_at = -1
            self._low_since = None
            return
        if not self.shrink:
            return
        now, recent = self.now_s, self._recent
        while recent and recent[-1][1] <= high_water:
            recent.pop()
        recent.append((now, high_water))
        while recent[0][0] < now - self.hold_s:
            recent.popleft()
        if self.covered_pages <= (1 + self.hysteresis) * high_water + self.min_slack_pages:
            self._low_since = None  # busy again: the hold starts over
            return
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since < self.hold_s:
            return
        # Keep room for the busiest moment of the last hold_s seconds, not the emptiest:
        # that is the need the traffic has shown, and below it the next burst would regrow.
        target = int((1 + self.hysteresis / 2) * recent[0][1]) + 1
        if target >= self.covered_pages:
            return
        if self.covered_pages == self._stuck_at and target >= self._retry_below:
            return
        if self.shrink_to(target):
            self._low_since = None
        else:
            self._stuck_at, self._retry_below = self.covered_pages, target // 2


class PageElastic(Strategy):
    """Map and unmap pages anywhere as slots come and go (kvcached's model).

    The owner backs whole granules, so what matters is which granules hold a used page: a
    granule is committed when it gains its first used page and decommitted when it loses its
    last. The strategy counts used pages per granule (per page geometry: buffers whose pages
    have other sizes map pages to other granules) and gives the owner one committed page per
    granule in use, its representative, rather than every used page: the owner's page calls
    cost Python work per page and buffer, and 1.4 M pages over 160 buffers in the hour's
    trace would not replay in 10 s. A representative stays committed until its granule
    empties, even if its own request finished; page 0 (slot 0) is never given back.

    Each boundary makes at most two owner calls, each one transaction: ``decommit_pages`` for
    the granules that emptied, then ``commit_pages`` for those newly in use (decommit first,
    so a pool's retained handles serve the commit of the same step).

    Args:
        pool: back commits from a :class:`~kvvmm.arena.pool.HandlePool` that keeps the
            handles decommits give back (up to ``retain_bytes``): a decommit-then-commit
            costs unmap + map instead of unmap + release + create + map. Its idle handles
            are memory too ("held by the pool" in the timeline).
        retain_bytes: the pool's cap (default: 4 granules per buffer: enough to absorb the
            churn at the used pages' frontier, small next to what backing saves).
    """

    def __init__(self, *, pool: bool = False, retain_bytes: int | None = None,
                 layout: str = "token_major") -> None:
        if layout not in ("token_major", "page_major", "interleaved"):
            raise ArgumentError("layout", layout, "'token_major', 'page_major' or "
                                                  "'interleaved'")
        self.layout = layout
        if retain_bytes is not None:
            int_arg("retain_bytes", retain_bytes, lo=0, unit="bytes")
        if retain_bytes is not None and not pool:
            raise ArgumentError("retain_bytes", retain_bytes, "None without a pool")
        self.pool = bool(pool)
        self.retain_bytes = retain_bytes
        self.name = ("xl-" if layout == "interleaved" else "") + \
            ("page-elastic+pool" if pool else "page-elastic")
        self.handle_pool: HandlePool | None = None

    def make_pool(self, driver: Driver) -> HandlePool | None:
        if not self.pool:
            return None
        # The default cap depends on the buffer count, known at bind (before any decommit
        # can give a handle back). threaded=False: nothing is created ahead, only retained,
        # so no thread is needed, and the sim's clock and the trace stay deterministic.
        self.handle_pool = HandlePool(driver, retain_bytes=self.retain_bytes or 0,
                                      threaded=False)
        return self.handle_pool

    def bind(self, owner: KvBufferOwner, *, pool_pages: int) -> None:
        super().bind(owner, pool_pages=pool_pages)
        gran = owner.arena.granularity
        ps = owner.page_size
        kinds = Counter(d.row_bytes * ps // d.tokens_per_row for d in owner.descs)
        self._gran = gran
        self._kinds = sorted(kinds)  # page bytes of each geometry
        # granule -> used pages, per geometry: a list indexed by granule (the pages of
        # every step boundary pass through it)
        self._count: list[list[int]] = [[0] * ((pool_pages * pb - 1) // gran + 1)
                                        for pb in self._kinds]
        self._rep: list[dict[int, int]] = [{} for _ in self._kinds]  # granule -> its page
        self._refs: dict[int, int] = {}  # committed page -> granules it represents
        self._committed: set[int] = {0}  # the owner backed slot 0's page at construction
        if self.handle_pool is not None and self.retain_bytes is None:
            self.handle_pool.retain_bytes = 4 * gran * len(owner.descs)
        # Slot 0's page is in use for good (captured graphs write it): its granules never
        # empty, so page 0 stays their representative and is never given back.
        self._add([0], [])
        for k, rep in enumerate(self._rep):
            for g in self._granules(k, 0):
                rep[g] = 0
        self._refs[0] = 1

    def _granules(self, k: int, p: int) -> range:
        pb = self._kinds[k]
        return range(p * pb // self._gran, ((p + 1) * pb - 1) // self._gran + 1)

    def _add(self, pages: list[int], gained: list[tuple[int, int, int]]) -> None:
        gran = self._gran
        for k, (pb, count) in enumerate(zip(self._kinds, self._count, strict=True)):
            rep = self._rep[k]
            if not gran % pb:  # whole pages per granule: each page is in one (the usual case)
                ppg = gran // pb
                for p in pages:
                    g = p // ppg
                    c = count[g]
                    count[g] = c + 1
                    if c == 0 and g not in rep:
                        gained.append((k, g, p))
                continue
            for p in pages:
                for g in range(p * pb // gran, ((p + 1) * pb - 1) // gran + 1):
                    c = count[g]
                    count[g] = c + 1
                    if c == 0 and g not in rep:
                        gained.append((k, g, p))

    def _drop(self, pages: list[int], lost: list[tuple[int, int]]) -> None:
        gran = self._gran
        for k, (pb, count) in enumerate(zip(self._kinds, self._count, strict=True)):
            if not gran % pb:
                ppg = gran // pb
                for p in pages:
                    g = p // ppg
                    c = count[g] - 1
                    count[g] = c
                    if c == 0:
                        lost.append((k, g))
                continue
            for p in pages:
                for g in range(p * pb // gran, ((p + 1) * pb - 1) // gran + 1):
                    c = count[g] - 1
                    count[g] = c
                    if c == 0:
                        lost.append((k, g))

    def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
        gained: list[tuple[int, int, int]] = []
        lost: list[tuple[int, int]] = []
        self._add(allocated, gained)  # allocations first: a page freed and reused stays
        if freed:
            self._drop(freed, lost)
        if not lost and not gained:
            return
        refs = self._refs
        changed: set[int] = set()
        for k, g in lost:
            rep = self._rep[k]
            if self._count[k][g] == 0 and g in rep:
                p = rep.pop(g)
                refs[p] -= 1
                changed.add(p)
        for k, g, p in gained:
            rep = self._rep[k]
            if self._count[k][g] > 0 and g not in rep:
                rep[g] = p
                refs[p] = refs.get(p, 0) + 1
                changed.add(p)
        drop = sorted(p for p in changed if refs.get(p) == 0)
        add = sorted(p for p in changed if refs.get(p, 0) > 0 and p not in self._committed)
        for p in drop:
            del refs[p]
        if drop:
            self._committed.difference_update(drop)
            if self.owner.decommit_pages(drop):
                self.changes += 1
        if add:
            self._committed.update(add)
            if self.owner.commit_pages(add):
                self.changes += 1


class LeaseAllocator(SlotAllocator):
    """The engine's page allocator over a :class:`~kvvmm.owner.RangeBacking`: each request
    holds one lease, its pages the lease's slots in order; a request that outgrows its lease
    grows it (in place when the next blocks are free). The serving loop waits for a lease
    that is not ready (the executor charges that wait).

    ``defer_unready``: an admission whose lease is not mapped yet at the step boundary is
    admitted at a later one (:meth:`prepare` says False; the lease stays taken, its commit
    on the backing thread), as an engine that checks :attr:`Lease.ready` before it
    schedules a prefill does: the step does not wait for it. Growths during decode still
    wait (the request needs the page in this step).

    ``admit_wait_s`` (with ``defer_unready``): the step first spins on
    :attr:`Lease.ready` for up to this long past its boundary (all of the boundary's
    admissions together): a commit that ends by then is waited for (the step stalls by
    what is left of it, decode-path time) and the request admitted now; one that does not
    is put off as above, the spin lost. A put-off waits a whole step, 10-150 ms on the
    conversation trace, for a commit that mostly ends well under a millisecond after the
    boundary (docs/ELASTIC.md, "First-token delay").
    """

    def __init__(self, backing: RangeBacking, page_size: int, *,
                 defer_unready: bool = False, inline: bool = False,
                 admit_wait_s: float = 0.0) -> None:
        self.backing = backing
        self.defer_unready = defer_unready
        self.admit_wait_s = _admit_wait(admit_wait_s)
        self.inline = inline  #: commits on the engine's thread: nothing to wait for
        self.ps = page_size
        self.ppb = backing.block_tokens // page_size
        self.pages = backing.blocks * self.ppb
        self.order = "ranges"
        self._leases: dict[int, _Held] = {}  # rid -> its lease
        self._high_water: int | None = None  # high_water, None until read after a change
        self.used = 0
        self._cap = (backing.blocks - backing.first) * self.ppb
        self.admits = 0  #: leases taken
        self.split_admits = 0  #: leases that got more than one range (no free run held them)
        self.grows = self.grows_moved = 0  #: lease growths; those that took a new range
        self._frag_sum = 0.0
        self.frag_max = 0.0  #: the most fragmented the free blocks were at an admission
        self.units_max = 0  #: the most mapped units (one handle each) at an admission
        #: what the current call does: "admit", "grow" or "hand" (pages of its lease)
        self.doing = "hand"
        self.stalled_admits = 0  #: admissions a decode step waited for (the executor counts)
        self.stalled_grows = 0  #: lease growths a decode step waited for
        #: during :meth:`prepare`: the executor records when the lease's commit ends
        #: (``ready_at``) instead of making the step wait for it
        self.deferring = False
        self.ready_at = 0.0
        # prepared leases not yet mapped: rid -> (when mapped, the boundary first put off)
        self._ready_at: dict[int, tuple[float, float]] = {}
        self.deferred_admits = 0  #: admissions put off to a later boundary (not ready)
        self.deferred_s = 0.0  #: serving seconds those admissions waited, in all
        self.deferred_max_s = 0.0  #: the longest one admission was put off
        self.waited_admits = 0  #: admissions a step waited for, within ``admit_wait_s``
        self.admit_waited_s = 0.0  #: decode-path seconds the steps spun on leases, in all
        self.spun_out = 0  #: spins that ran out (the lease not ready): put off after all
        self._spin_at = -1.0  # the boundary the decode thread spins at ...
        self._spun_to = 0.0  # ... and until when it has spun there (serving seconds)
        self._step_wait = 0.0  # spin time the runner has not yet added to a step

    def take_wait(self) -> float:
        """Seconds the step at this boundary spun on leases since the last call (the runner
        adds them to the step's driver stall: decode-path time)."""
        w, self._step_wait = self._step_wait, 0.0
        return w

    def _spin(self, until: float) -> None:
        """The decode thread spins on :attr:`Lease.ready` until serving time ``until``."""
        if until > self._spun_to:
            self._step_wait += until - self._spun_to
            self.admit_waited_s += until - self._spun_to
            self._spun_to = until

    @property
    def free(self) -> int:
        s = self.backing
        return s.free_blocks * self.ppb

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def high_water(self) -> int:
        # Read at every step boundary, changed only when a lease comes, grows or goes:
        # worked out again only then (a scan of every lease's ranges).
        top = self._high_water
        if top is None:
            top = 1
            for held in self._leases.values():
                for s, n in held.lease.pieces:
                    top = max(top, (s + n) * self.ppb)
            self._high_water = top
        return top

    @high_water.setter
    def high_water(self, value: int) -> None:
        pass

    def can_alloc(self, rid: int, n: int) -> bool:
        got = self._leases.get(rid)
        spare = 0 if got is None else len(got.pages) - got.handed
        return n <= spare + self.free

    def _admit(self, rid: int, n: int) -> _Held:
        st = self.backing.stats()  # what the admission found
        lease = self.backing.admit(n * self.ps)
        got = _Held(lease, lease.pages(self.ps))
        self._leases[rid] = got
        self._high_water = None
        self.admits += 1
        self.split_admits += len(lease.pieces) > 1
        self._frag_sum += st.fragmentation
        self.frag_max = max(self.frag_max, st.fragmentation)
        self.units_max = max(self.units_max, st.units)
        return got

    def prepare(self, rid: int, n: int) -> bool:
        if not self.defer_unready:
            return True
        now = self.now_s
        if rid not in self._leases:
            self.doing = "admit"
            self.deferring, self.ready_at = True, 0.0
            try:
                self._admit(rid, n)
            finally:
                self.deferring = False
            when, since = self.ready_at, now
        else:
            got = self._ready_at.get(rid)
            if got is None:
                return True
            when, since = got
        if self._spin_at != now:  # a new boundary: the decode thread has not spun yet
            self._spin_at, self._spun_to = now, now
        if when > self._spun_to:  # not mapped by the time the step got to it
            until = now + self.admit_wait_s
            if when > until:  # spin until the bound (if any), then put it off
                self.spun_out += until > self._spun_to
                self._spin(until)
                if rid not in self._ready_at:
                    self.deferred_admits += 1
                self._ready_at[rid] = (when, since)
                return False
            self._spin(when)
            self.waited_admits += 1
        if self._ready_at.pop(rid, None) is not None:
            waited = now - since
            self.deferred_s += waited
            self.deferred_max_s = max(self.deferred_max_s, waited)
        return True

    def ready_s(self, rid: int) -> float:
        got = self._ready_at.get(rid)
        return self.now_s if got is None else got[0]

    def unprepare(self, rid: int) -> None:
        got = self._leases.get(rid)
        if got is not None and got.handed == 0:
            self._ready_at.pop(rid, None)
            self.release_for(rid, [])

    def alloc_for(self, rid: int, n: int, out: list[int]) -> None:
        got = self._leases.get(rid)
        self.doing = "admit" if got is None else \
            "grow" if got.handed + n > len(got.pages) else "hand"
        if got is None:
            got = self._admit(rid, n)
        elif got.handed + n > len(got.pages):
            ranges = len(got.lease.pieces)
            self._high_water = None
            self.backing.grow(got.lease, (got.handed + n) * self.ps)
            got.pages = got.lease.pages(self.ps)
            self.grows += 1
            self.grows_moved += len(got.lease.pieces) > ranges
        if not got.lease.ready:
            self.backing.wait(got.lease)
        out.extend(got.pages[got.handed:got.handed + n])
        got.handed += n
        self.used += n

    def range_stats(self) -> dict[str, float]:
        """How the range allocator fared over the run (for the summary row)."""
        a = max(1, self.admits)
        return {"admits": self.admits, "split_admits": self.split_admits,
                "grows": self.grows, "grows_moved": self.grows_moved,
                "fragmentation_mean": round(self._frag_sum / a, 4),
                "fragmentation_max": round(self.frag_max, 4), "units_max": self.units_max,
                "inline": self.inline,
                "stalled_admits": self.stalled_admits, "stalled_grows": self.stalled_grows,
                "deferred_admits": self.deferred_admits,
                "deferred_ms": round(self.deferred_s * 1e3, 3),
                "deferred_max_ms": round(self.deferred_max_s * 1e3, 3),
                "admit_wait_ms": round(self.admit_wait_s * 1e3, 3),
                "waited_admits": self.waited_admits,
                "admit_waited_ms": round(self.admit_waited_s * 1e3, 3),
                "spun_out": self.spun_out}

    def release_for(self, rid: int, pages: Sequence[int]) -> None:
        got = self._leases.pop(rid, None)
        if got is None:
            return
        self._high_water = None
        self.used -= got.handed
        self.backing.release(got.lease)


#: the longest bounded wait for a lease at admission, seconds: past a decode step's length
#: (10-150 ms on the conversation trace) putting the request off a step costs it less
MAX_ADMIT_WAIT_S = 0.1
#: the default: above what a lease's commit costs on the card at admission (0.03-0.27 ms
#: past the boundary on the conversation trace, sim with the H200's costs), below the
#: 5 ms worst step (docs/ELASTIC.md, "First-token delay")
ADMIT_WAIT_S = 1e-3


def _admit_wait(v: object) -> float:
    return number_arg("admit_wait_s", v, lo=0.0, hi=MAX_ADMIT_WAIT_S,
                      limit=f"a number of seconds in [0, {MAX_ADMIT_WAIT_S}]")


class _Held:
    __slots__ = ("handed", "lease", "pages")

    def __init__(self, lease: Lease, pages: list[int]) -> None:
        self.lease = lease
        self.pages = pages  # the lease's pages in order
        self.handed = 0  # how many of them the request holds


class RequestRanges(Strategy):
    """Request-granular backing on the interleaved layout (:class:`~kvvmm.owner.RangeBacking`).

    Args:
        deferred: keep released blocks mapped for reuse, keep ``reserve_bytes`` mapped ahead,
            give back above ``high_bytes``, all of it off the decode path; False: every
            commit and give-back runs on the decode path at once (request ranges alone).
        reserve_bytes: with ``deferred``: free memory kept mapped ahead (default 48 MiB).
        high_bytes: with ``deferred``: cached memory above this is given back (default
            ``reserve_bytes + 32 MiB``). The defaults are the point of the sweep over the
            conversation trace's first 10 minutes (llama-3.1-70b TP8 rank 0, sim, H200
            profile) where mean backed stays within 1.25x mean used and the decode path
            pays less driver time than prefix growth (docs/ELASTIC.md).
        defer_admissions: with ``deferred`` (default True): a request whose lease is not
            mapped yet at the step boundary is admitted at a later one (the engine checks
            :attr:`~kvvmm.owner.Lease.ready`) instead of the step waiting for its commit;
            False: the step waits (what the lab measured before, 2026-12-06).
        admit_wait_s: with admissions put off: how long past its boundary a step first
            spins on :attr:`~kvvmm.owner.Lease.ready` for the leases it admits, seconds in
            ``[0, MAX_ADMIT_WAIT_S]`` (default :data:`ADMIT_WAIT_S`, 1 ms): a commit that
            ends by then stalls the step by what is left of it and the request starts now;
            a longer one is put off a step (0: every unready one is).
    """

    layout = "interleaved"

    def __init__(self, *, deferred: bool = False, reserve_bytes: int | None = None,
                 high_bytes: int | None = None, defer_admissions: bool | None = None,
                 admit_wait_s: float | None = None) -> None:
        bool_arg("deferred", deferred)
        for nm, v in (("reserve_bytes", reserve_bytes), ("high_bytes", high_bytes)):
            if v is not None:
                int_arg(nm, v, lo=0, unit="bytes")
        if defer_admissions is not None:
            bool_arg("defer_admissions", defer_admissions)
        if admit_wait_s is not None:
            _admit_wait(admit_wait_s)
        given: tuple[tuple[str, object], ...] = (
            ("reserve_bytes", reserve_bytes), ("high_bytes", high_bytes),
            ("defer_admissions", defer_admissions), ("admit_wait_s", admit_wait_s))
        for nm, val in given:
            if val is not None and not deferred:
                raise ArgumentError(nm, val, "None without deferred=True")
        if admit_wait_s is not None and defer_admissions is False:
            raise ArgumentError("admit_wait_s", admit_wait_s,
                                "None with defer_admissions=False (every step waits then)")
        self.deferred = deferred
        self.defer_admissions = deferred if defer_admissions is None else defer_admissions
        self.admit_wait_s = (ADMIT_WAIT_S if admit_wait_s is None else float(admit_wait_s)) \
            if self.defer_admissions else 0.0
        self.reserve_bytes = (48 << 20 if reserve_bytes is None else reserve_bytes) \
            if deferred else 0
        self.high_bytes = (self.reserve_bytes + (32 << 20) if high_bytes is None
                           else high_bytes) if deferred else 0
        self.name = "request-ranges+deferred" if deferred else "request-ranges"
        self.backing: RangeBacking | None = None

    def make_allocator(self, executor: Callable[[Callable[[], None], bool], None]
                       ) -> SlotAllocator | None:
        run: Callable[[Callable[[], None], bool], None] | str = \
            executor if self.deferred else "inline"
        self.backing = RangeBacking(self.owner, reserve_bytes=self.reserve_bytes,
                                    high_bytes=self.high_bytes, executor=run)
        return LeaseAllocator(self.backing, self.page_size,
                              defer_unready=self.defer_admissions, inline=run == "inline",
                              admit_wait_s=self.admit_wait_s)

    def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
        pass  # the allocator backs each lease as it hands it out

    def close(self) -> None:
        if self.backing is not None:
            self.backing.close()


#: Strategy names the CLI and the lab accept, and how to build each.
STRATEGIES = ("static", "finalize", "prefix", "prefix+shrink", "page-elastic",
              "page-elastic+pool", "xl-page-elastic", "request-ranges",
              "request-ranges+deferred", "vllm-extensible")


def make_strategy(name: str, policy: GrowthPolicy | None = None) -> Strategy:
    """A fresh strategy by name (one of :data:`STRATEGIES`)."""
    if name == "static":
        return Static()
    if name == "finalize":
        return PostCaptureFinalize()
    if name == "prefix":
        return PrefixGrowth(policy)
    if name == "prefix+shrink":
        return PrefixGrowth(policy, shrink=True)
    if name == "page-elastic":
        return PageElastic()
    if name == "page-elastic+pool":
        return PageElastic(pool=True)
    if name == "xl-page-elastic":
        return PageElastic(layout="interleaved")
    if name == "request-ranges":
        return RequestRanges()
    if name == "request-ranges+deferred":
        return RequestRanges(deferred=True)
    if name == "vllm-extensible":
        from kvvmm.workload.engines import VllmExtensible  # it builds on this module
        return VllmExtensible()
    raise ArgumentError("strategy", name, f"one of {', '.join(STRATEGIES)}")
