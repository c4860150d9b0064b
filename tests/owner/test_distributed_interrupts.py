"""A collective resize interrupted anywhere (Ctrl-C, SystemExit: not an Exception, so the
steps' own handlers never see it) gives back exactly what it made or mapped (hardening round
2, class 10). One gloo rank in this process; the interrupt is raised inside the create of the
prepare, the agreement, the map and the confirmation."""

from __future__ import annotations

from typing import Any

import pytest

from kvvmm import KvBufferOwner, SimDriver, mha_token_major
from kvvmm.driver import FaultyDriver

TOKENS = 36_000


class _Interrupting(FaultyDriver):
    """Raises ``exc`` at the ``nth`` create once armed."""

    def __init__(self, inner: SimDriver) -> None:
        super().__init__(inner)
        self.at: int | None = None
        self.exc: type[BaseException] = KeyboardInterrupt

    def create(self, size: int) -> int:
        if self.at is not None:
            self.at -= 1
            if self.at == 0:
                self.at = None
                raise self.exc()
        return super().create(size)


def _setup() -> tuple[_Interrupting, KvBufferOwner, Any]:
    from kvvmm.owner.distributed import DistributedOwner

    drv = _Interrupting(SimDriver("h200"))
    descs = mha_token_major(layers=2, kv_heads=4, head_dim=64, reserved_tokens=TOKENS,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=TOKENS,
                          descs=descs)
    return drv, owner, DistributedOwner(owner, timeout_s=30)


def _state(drv: _Interrupting, owner: KvBufferOwner) -> tuple[object, ...]:
    st = drv.stats()
    return (st.handles, st.mappings, st.mapped_bytes, owner.backed_bytes,
            owner.arena.snapshot().mappings)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("where", ["create 1", "create 3", "agree", "adopt 2", "confirm"])
def test_an_interrupted_collective_resize_leaves_every_handle_as_it_was(
        gloo_world_of_one: None, monkeypatch: pytest.MonkeyPatch, where: str,
        exc: type[BaseException]) -> None:
    drv, owner, dist_owner = _setup()
    before = _state(drv, owner)
    if where.startswith("create"):
        drv.at, drv.exc = int(where.split()[1]), exc
    elif where in ("agree", "confirm"):
        real = dist_owner._agree
        calls = {"n": 0}

        def agree(*a: Any, **k: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == (1 if where == "agree" else 2):
                raise exc()
            return real(*a, **k)

        monkeypatch.setattr(dist_owner, "_agree", agree)
    else:
        real_adopt = owner.arena.adopt
        n = {"k": 0}

        def adopt(*a: Any, **k: Any) -> Any:
            n["k"] += 1
            if n["k"] == 2:
                raise exc()
            return real_adopt(*a, **k)

        monkeypatch.setattr(owner.arena, "adopt", adopt)
    with pytest.raises(exc):
        dist_owner.ensure_prefix(TOKENS // 2)
    monkeypatch.undo()
    assert _state(drv, owner) == before, where  # nothing made or mapped stays
    owner.arena.snapshot().check()
    assert dist_owner.ensure_prefix(TOKENS // 2) > 0  # and the owner works on
    owner.close()
    assert drv.stats().clean
