"""Sim-vs-CUDA parity: the same random operation sequences (valid and refused ones) on
``SimDriver(profile="h200")`` and on ``CudaDriver`` get the same accept/refuse decision and
error name at every step, and end with the same mappings."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kvvmm import DriverError, SimDriver
from kvvmm.driver.base import Driver
from kvvmm.units import GiB, MiB

G = 2 * MiB


@dataclass
class Pair:
    sim: int
    cuda: int
    size: int


def outcome(fn: Callable[[], object]) -> tuple[str, object]:
    try:
        return "ok", fn()
    except DriverError as e:
        return e.cuda_error, None


class Twin:
    """Runs each step on both drivers and records where they disagree.

    Steps only ever name live reservations, and start inside them: CUDA hands freed VA out
    again and the simulator never does, and the simulator's reservations sit back to back
    while CUDA's need not, so an address outside a live reservation would mean different
    things to the two (a difference of address assignment, not of the rules). Freeing twice
    and mapping into freed VA are covered by the rule tests instead.
    """

    def __init__(self, sim: Driver, cuda: Driver) -> None:
        self.sim, self.cuda = sim, cuda
        self.res: list[Pair] = []  # reservations (live or freed: stale ones are refused)
        self.handles: list[Pair] = []  # handles (live or released)
        self.maps: list[tuple[int, int, int]] = []  # (reservation index, offset, size)
        self.mismatches: list[str] = []
        self.steps = 0
        self.refused = 0

    def both(self, label: str, f: Callable[[Driver, int], object]) -> tuple[bool, object, object]:
        a, ra = outcome(lambda: f(self.sim, 0))
        b, rb = outcome(lambda: f(self.cuda, 1))
        self.steps += 1
        if a != b:
            self.mismatches.append(f"step {self.steps} {label}: sim {a}, cuda {b}")
        if a != "ok":
            self.refused += 1
        return a == "ok" and b == "ok", ra, rb

    def va(self, r: int, off: int, which: int) -> int:
        p = self.res[r]
        return (p.sim, p.cuda)[which] + off

    def step(self, rng: random.Random) -> None:
        op = rng.choices(
            ["reserve", "free", "create", "release", "map", "unmap", "access"],
            [6, 3, 14, 8, 30, 22, 17])[0]
        live_h_bytes = sum(p.size for p in self.handles if p.size > 0)
        if op == "reserve" and sum(p.size > 0 for p in self.res) > 6:
            op = "free"
        if op == "reserve" or not self.res:
            size = rng.choice([G * rng.randint(1, 64), G * rng.randint(1, 8) + 4096, 0])
            ok, a, b = self.both(f"reserve({size})", lambda d, w: d.reserve(size, 0))
            if ok:
                assert isinstance(a, int) and isinstance(b, int)
                self.res.append(Pair(a, b, size))
        elif op == "free":
            live_r = [k for k, p in enumerate(self.res) if p.size > 0]
            if not live_r:
                return
            r = rng.choice(live_r)
            size = self.res[r].size + rng.choice([0, 0, 0, G])
            ok, _, _ = self.both(f"free(res{r}, {size})",
                                 lambda d, w: d.free(self.va(r, 0, w), size))
            if ok:
                self.res[r] = Pair(self.res[r].sim, self.res[r].cuda, -1)  # stale
        elif op == "create":
            size = rng.choice([G * rng.randint(1, 8)] * 6 + [G + 4096, 0, 200 * GiB])
            if live_h_bytes > 2 * GiB and size < 100 * GiB:
                return
            ok, a, b = self.both(f"create({size})", lambda d, w: d.create(size))
            if ok:
                assert isinstance(a, int) and isinstance(b, int)
                self.handles.append(Pair(a, b, size))
        elif op == "release":
            if not self.handles:
                return
            i = rng.randrange(len(self.handles))
            h = self.handles[i]
            ok, _, _ = self.both(f"release(h{i})", lambda d, w: d.release((h.sim, h.cuda)[w]))
            if ok:
                self.handles[i] = Pair(h.sim, h.cuda, -abs(h.size))  # released
        elif op == "map":
            if not self.handles:
                return
            live_r = [k for k, p in enumerate(self.res) if p.size > 0]
            live_h = [k for k, p in enumerate(self.handles) if p.size > 0]
            if not live_r:
                return
            sensible = rng.random() < 0.8 and live_h
            r = rng.choice(live_r)
            i = rng.choice(live_h) if sensible else rng.randrange(len(self.handles))
            h = self.handles[i]
            span = max(self.res[r].size, G)
            if sensible and abs(h.size) <= span:
                off = rng.randrange(0, (span - abs(h.size)) // G + 1) * G
            else:  # starts inside the reservation, may run past its end
                off = rng.randrange(0, span // G) * G + rng.choice([0] * 9 + [4096])
            size = abs(h.size) + rng.choice([0] * 8 + [-G, G])
            ok, _, _ = self.both(
                f"map(res{r}+{off:#x}, {size}, h{i})",
                lambda d, w: d.map(self.va(r, off, w), size, (h.sim, h.cuda)[w]))
            if ok:
                self.maps.append((r, off, size))
        elif op in ("unmap", "access"):
            if self.maps and rng.random() < 0.85:
                r, off, size = rng.choice(self.maps)
                kind = rng.choice(["whole"] * 6 + ["part", "two", "shifted"])
                if kind == "part" and size > G:
                    size -= G
                elif kind == "two":
                    nxt = [m for m in self.maps if m[0] == r and m[1] == off + size]
                    if nxt:
                        size += nxt[0][2]
                elif kind == "shifted":
                    off += G
            else:
                live_r = [k for k, p in enumerate(self.res) if p.size > 0]
                if not live_r:
                    return
                r = rng.choice(live_r)
                off = G * rng.randrange(0, max(self.res[r].size, G) // G)
                size = G * rng.randint(1, 4)
            name = "unmap" if op == "unmap" else "set_access"
            ok, _, _ = self.both(
                f"{name}(res{r}+{off:#x}, {size})",
                lambda d, w: getattr(d, name)(self.va(r, off, w), size))
            if ok and op == "unmap":
                end = off + size
                self.maps = [m for m in self.maps if not (m[0] == r and off <= m[1] < end)]

    def teardown(self) -> None:
        """Give everything back; best effort, so a mismatch earlier cannot crash it."""
        for d, w in ((self.sim, 0), (self.cuda, 1)):
            for r, off, size in self.maps:
                outcome(lambda d=d, w=w, r=r, off=off, size=size: d.unmap(  # type: ignore[misc]
                    self.va(r, off, w), size))
            for h in self.handles:
                if h.size > 0:
                    outcome(lambda d=d, w=w, h=h: d.release((h.sim, h.cuda)[w]))  # type: ignore[misc]
            for p in self.res:
                if p.size > 0:
                    outcome(lambda d=d, w=w, p=p: d.free((p.sim, p.cuda)[w], p.size))  # type: ignore[misc]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operation_sequences_get_the_same_answers_on_sim_and_cuda(
    seed: int, open_cuda_on_path: Callable[..., Driver]
) -> None:
    torch.empty(1, device="cuda")
    cuda = open_cuda_on_path()
    twin = Twin(SimDriver("h200"), cuda)
    rng = random.Random(seed)
    try:
        while twin.steps < 2000:
            twin.step(rng)
        s, c = twin.sim.stats(), twin.cuda.stats()
        final_sim = (s.reservations, s.reserved_bytes, s.handles, s.mappings, s.mapped_bytes,
                     s.physical_bytes)
        final_cuda = (c.reservations, c.reserved_bytes, c.handles, c.mappings, c.mapped_bytes,
                      c.physical_bytes)
        assert not twin.mismatches, (
            f"{len(twin.mismatches)} of {twin.steps} steps differ:\n"
            + "\n".join(twin.mismatches[:30]))
        assert twin.refused > 200, twin.refused  # the sequences exercise refusals too
        assert final_sim == final_cuda
        twin.teardown()
        assert twin.sim.stats().clean and twin.cuda.stats().clean
    finally:
        cuda.close()  # whatever is left, so later tests start clean
