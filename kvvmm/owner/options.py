"""OwnerOptions: how a :class:`~kvvmm.owner.KvBufferOwner` backs, apart from its layout.

One frozen record an engine builds once and passes to every owner it makes
(``dataclasses.replace`` changes one field); the constructor also takes its fields as keywords.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvvmm.arena.pool import HandlePool
from kvvmm.arena.reclaim import CacheReleaser
from kvvmm.checks import bool_arg, int_arg
from kvvmm.errors import ArgumentError
from kvvmm.policy import GrowthPolicy, default_policy
from kvvmm.record.trace import Trace

__all__ = ["OwnerOptions"]


@dataclass(frozen=True, slots=True)
class OwnerOptions:
    """How an owner backs its buffers; every field checked when the record is made.

    Args:
        policy: a growth policy *instance* for ``ensure_prefix`` (default:
            :func:`~kvvmm.policy.default_policy`).
        name: the arena's name.
        trace: a :class:`~kvvmm.record.Trace` the arena records its operations in.
        pool: a :class:`~kvvmm.arena.pool.HandlePool` of the owner's driver for the arena
            (commits take its handles, decommits give handles back to it).
        lookahead_bytes: with ``pool``: per buffer, bytes beyond the ensured prefix backed
            ahead of need on the pool's thread (topped up once less than half is left).
            0 (default): no look-ahead.
        cache_releaser, retry_on_oom: as for :class:`~kvvmm.arena.Arena`.
    Raises:
        ArgumentError: a bad field, naming it; a policy class instead of an instance.
    """

    policy: GrowthPolicy | None = None
    name: str = "kv"
    trace: Trace | None = None
    pool: HandlePool | None = None
    lookahead_bytes: int = 0
    cache_releaser: CacheReleaser | None = None
    retry_on_oom: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", _checked_policy(self.policy))
        if self.pool is not None and not isinstance(self.pool, HandlePool):
            raise ArgumentError("pool", self.pool, "a kvvmm.arena.pool.HandlePool or None")
        int_arg("lookahead_bytes", self.lookahead_bytes, lo=0, unit="bytes")
        if self.lookahead_bytes and self.pool is None:
            raise ArgumentError("lookahead_bytes", self.lookahead_bytes,
                                "0 without a pool (the look-ahead runs on the pool's thread)")
        bool_arg("retry_on_oom", self.retry_on_oom, limit="a bool")
        if self.cache_releaser is not None and not isinstance(self.cache_releaser,
                                                                 CacheReleaser):
            raise ArgumentError("cache_releaser", self.cache_releaser,
                                "an object with release_cached(need_bytes) -> int, or None")

    @property
    def growth(self) -> GrowthPolicy:
        """The policy, never None (the default filled in when the record was made)."""
        assert self.policy is not None
        return self.policy

    @classmethod
    def of(cls, options: OwnerOptions | None, settings: dict[str, Any]) -> OwnerOptions:
        """``options`` with the constructor's keyword ``settings`` (its fields) applied; a
        field given both ways, or a keyword that is no field, is refused."""
        if options is not None and not isinstance(options, OwnerOptions):
            raise ArgumentError("options", options, "an OwnerOptions or None")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - fields)
        if unknown:
            raise TypeError(f"KvBufferOwner() got unexpected keyword argument(s) {unknown} "
                            f"(OwnerOptions has {sorted(fields)})")
        if options is None:
            return cls(**settings)
        if settings:
            both = sorted(settings)
            raise ArgumentError("options", options, f"options or the keywords {both}, not both "
                                                    "(dataclasses.replace(options, ...) "
                                                    "changes a field)")
        return options


def _checked_policy(policy: object) -> GrowthPolicy:
    """The default for None; refuse a policy class (``Exact``, not ``Exact()``) and non-policies."""
    if policy is None:
        return default_policy()
    if isinstance(policy, type):
        raise ArgumentError("policy", policy, f"a policy instance such as {policy.__name__}() "
                                              f"(the class was passed, not an instance)")
    if not isinstance(policy, GrowthPolicy):
        raise ArgumentError("policy", policy, "Exact(), Chunked(...), Geometric(...) or an "
                                              "object with target_bytes(backed, need, limit, gran)")
    return policy
