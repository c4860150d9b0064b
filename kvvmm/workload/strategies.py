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

Page-elastic backing (map and unmap pages anywhere as slots come and go, kvcached's model)
needs page-granular owner calls (``commit_pages``/``decommit_pages``) that the owner does not
have yet; until it does, the runner reports what such a strategy would back at best
(``elastic_bytes``: every granule a used page touches), with no driver cost, next to the
strategies that run.

A strategy of your own is a subclass that sets ``name`` and overrides ``update``; the
helpers :meth:`Strategy.grow_to` and :meth:`Strategy.shrink_to` keep :attr:`covered_pages`
(pages ``[0, covered_pages)`` are backed in every buffer) in step with the owner.
"""

from __future__ import annotations

from kvvmm.errors import ArgumentError
from kvvmm.owner import KvBufferOwner
from kvvmm.policy import GrowthPolicy, default_policy

__all__ = ["STRATEGIES", "PostCaptureFinalize", "PrefixGrowth", "Static", "Strategy",
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
        hysteresis: shrink when the backed pages exceed ``(1 + hysteresis) * high_water +
            min_slack_pages``, down to ``(1 + hysteresis / 2) * high_water`` (> 0): without
            it a pool at a steady size would shrink and regrow at every request.
        min_slack_pages: pages beyond the need never worth a shrink, >= 0 (default: one
            granule of the first buffer: less than that a shrink cannot give back).
    """

    def __init__(self, policy: GrowthPolicy | None = None, *, shrink: bool = False,
                 hysteresis: float = 1.0, min_slack_pages: int | None = None) -> None:
        if not (isinstance(hysteresis, (int, float)) and hysteresis > 0):
            raise ArgumentError("hysteresis", hysteresis, "a number > 0")
        bad = isinstance(min_slack_pages, bool) or not isinstance(min_slack_pages, int) \
            or min_slack_pages < 0
        if min_slack_pages is not None and bad:
            raise ArgumentError("min_slack_pages", min_slack_pages, "an int >= 0 (pages)")
        self.policy = default_policy() if policy is None else policy
        self.shrink = shrink
        self.hysteresis = float(hysteresis)
        self._min_slack = min_slack_pages
        self.min_slack_pages = 0 if min_slack_pages is None else min_slack_pages
        self.name = "prefix+shrink" if shrink else "prefix"
        # After a shrink that gave nothing back (a handle straddles the target), retry only
        # when the backing changed or the target halved: each try costs a snapshot.
        self._stuck_at = -1
        self._retry_below = 0

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
        elif (self.shrink and freed
              and self.covered_pages > (1 + self.hysteresis) * high_water
              + self.min_slack_pages):
            target = int((1 + self.hysteresis / 2) * high_water) + 1
            if self.covered_pages == self._stuck_at and target >= self._retry_below:
                return
            if not self.shrink_to(target):
                self._stuck_at, self._retry_below = self.covered_pages, target // 2


#: Strategy names the CLI and the lab accept, and how to build each.
STRATEGIES = ("static", "finalize", "prefix", "prefix+shrink")


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
    raise ArgumentError("strategy", name, f"one of {', '.join(STRATEGIES)}")
