"""Serving hooks for tests of the serving loop alone (``ServingModel.run`` without a strategy)."""

from __future__ import annotations


class QuietHooks:
    """Serving hooks with no memory strategy behind them: no stalls, nothing sampled."""

    kv_bandwidth_factor = 1.0

    def update(self, *a: object) -> float:
        return 0.0

    def sample(self, *a: object) -> None:
        pass
