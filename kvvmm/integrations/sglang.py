"""SGLang's ``KvVmmBufferOwner``, backed by kvvmm: swap one import, keep SGLang's calls.

SGLang sizes its KV pool after CUDA-graph capture with ``kv_vmm_backing.KvVmmBufferOwner``
(``python/sglang/srt/mem_cache/kv_vmm_backing.py``, "the seed"). This module offers the same
class (keyword constructor, attributes, methods) on :class:`kvvmm.owner.KvBufferOwner`: no
C++ stub compiled per arena, every multi-step change undone on failure, a close that never
unmaps memory a live tensor can reach, and a snapshot the lab draws. Use it either way::

    from kvvmm.integrations.sglang import KvVmmBufferOwner   # code you can change
    import kvvmm.integrations.sglang as k; k.install()        # SGLang's own import, unchanged

or launch ``python -m kvvmm.integrations.sglang_launch sglang.launch_server ...`` so that
spawned workers get the swap too. docs/SGLANG.md lists every call SGLang makes and its test.

As the seed: ``tensors`` in ``buffer_descs`` order at their upper-bound shapes, slot 0's page
backed at construction; spans ``prefix = rows(n) * row_bytes`` and ``final = rows(n +
page_size) * row_bytes`` (``rows(n) = ceil(n / tokens_per_row)``), each rounded up to the
granularity; ``Exact()`` growth by default (``policy=`` chooses another), so backed bytes
equal the seed's; descriptors read duck-typed (``name``, ``shape``, ``row_bytes``,
``tokens_per_row``); ``reserved_num_tokens`` may be every slot the tensors hold (SGLang's
unified pool), and ``ensure_prefix`` reaches ``reserved_num_tokens + page_size``.

Where kvvmm deliberately differs:

- **Bounds, checked up front.** ``ensure_prefix`` takes ``0 <= n <= min(reserved_num_tokens
  + page_size, what the tensors hold)`` (the seed also takes a negative ``n`` as 0) and
  refuses the rest with ``OutOfRangeError`` (a ``ValueError``, as the seed's span check); the
  constructor checks ``page_size <= reserved_num_tokens <=`` the slots the tensors hold,
  ``row_bytes == prod(shape[1:]) * itemsize`` and unique names, where the seed fails later.
- **close with live tensors.** The seed unmaps under tensors SGLang still holds (an illegal
  address on the next touch); kvvmm gives the memory back when the last tensor over it goes.
  ``close(wait=True, timeout=...)`` waits for that (``BusyError`` on timeout); ``released``
  and ``live_tensors`` say where it stands.
- **Errors.** What the seed raises as ``RuntimeError`` reaches SGLang as an instance of both
  its kvvmm class and :class:`KvVmmError` (``KvvmmError`` + ``RuntimeError``), same fields and
  notes: ``except DriverOutOfMemoryError``, ``except KvvmmError`` and ``except RuntimeError``
  catch the same object. Argument errors stay ``ValueError``/``TypeError``.
- **Device.** ``device="cuda"``/``"cuda:N"`` opens kvvmm's CUDA driver on ``device_id`` with
  SGLang 0.5.23's own choices (``granularity="recommended"``, ``handle_type="auto"``;
  ``"minimum"`` and ``"none"`` are the seed's); ``driver=`` runs the class on any driver.

Later upstream calls: ``release_beyond(n)``, ``bytes_per_token()`` (rounded up as upstream),
``backed_tokens`` (O(1)). SGLang's memory saver (``--enable-memory-saver``): ``pause()`` /
``resume()`` give the pool's memory back and take it again at the same VA (kvvmm's sleep and
wake; bytes dropped by default, as SGLang's KV region, or ``backup="host"``), and
:class:`KvVmmMemorySaver` is the adapter SGLang calls: ``"kv_cache"`` pauses every
registered owner (all or none), other tags go to the adapter SGLang made.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import time
import types
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvvmm.checks import bool_arg, int_arg, is_int, seconds_arg
from kvvmm.driver import open_driver
from kvvmm.driver.base import HANDLE_TYPES, Driver, check_driver
from kvvmm.errors import (
    ArgumentError,
    BusyError,
    KvvmmError,
    OutOfRangeError,
    SleepRefusedError,
)
from kvvmm.integrations import twin_class
from kvvmm.layout import KvBufferDesc as _KvvmmDesc
from kvvmm.owner import KvBufferOwner
from kvvmm.policy import Exact, GrowthPolicy
from kvvmm.snapshot import OwnerSnapshot
from kvvmm.units import align_up  # the seed's module-level helper, re-exported

if TYPE_CHECKING:
    import torch

__all__ = [
    "KV_CACHE_TAG",
    "SGLANG_MODULE",
    "InstallResult",
    "KvBufferDesc",
    "KvVmmBufferOwner",
    "KvVmmError",
    "KvVmmMemorySaver",
    "align_up",
    "install",
    "uninstall",
]

#: The module SGLang imports the seed from.
SGLANG_MODULE = "sglang.srt.mem_cache.kv_vmm_backing"

#: ``handle_type=`` values, SGLang 0.5.23's choice first.
_HANDLE_TYPES = ("auto", *HANDLE_TYPES)


class KvVmmError(KvvmmError, RuntimeError):
    """A kvvmm failure SGLang catches as ``RuntimeError`` (the seed raised one there).

    Every such error from this module is also an instance of its own kvvmm class
    (``DriverOutOfMemoryError``, ``ClosedError``, ...): catch whichever the code knows.
    """


class runtime_errors:  # a namespace, lower-case as the module path it makes reads
    """The ``RuntimeError`` twins of kvvmm's errors (``class X(kvvmm.errors.X,
    KvVmmError)``), made on first use and kept here under their kvvmm name, so that a pickled
    error finds its class again."""


def as_runtime_error(err: KvvmmError) -> KvvmmError:
    """``err`` as an instance of its class's ``RuntimeError`` twin, same fields and notes.

    Argument errors (``ValueError``/``TypeError``) and errors that already are
    ``RuntimeError`` come back unchanged.
    """
    if isinstance(err, (ValueError, TypeError, RuntimeError)):
        return err
    try:
        # kvvmm errors rebuild from their fields through __reduce__ (they cross processes).
        reduced = err.__reduce__()
        args = reduced[1] if isinstance(reduced, tuple) and len(reduced) > 1 else err.args
        new: Any = twin_class(type(err), KvVmmError, runtime_errors, __name__)(*args)
        state = reduced[2] if isinstance(reduced, tuple) and len(reduced) > 2 else None
        if isinstance(state, dict):
            new.__dict__.update(state)
    except Exception:  # an error class that cannot be rebuilt: keep its text, lose its type
        return KvVmmError(str(err))
    return new  # type: ignore[no-any-return]


@contextmanager
def _sglang_errors() -> Iterator[None]:
    try:
        yield
    except KvvmmError as e:
        converted = as_runtime_error(e)
        if converted is e:
            raise
        raise converted from e


@dataclass(frozen=True, slots=True)
class KvBufferDesc(_KvvmmDesc):
    """kvvmm's :class:`~kvvmm.layout.KvBufferDesc` with SGLang's ``item_len_bytes``.

    Fields as SGLang's ``KvBufferDesc`` (``memory_pool.py``): ``name``, ``shape``,
    ``row_bytes``, ``tokens_per_row``; spans as :class:`kvvmm.layout.KvBufferDesc`.
    """

    def item_len_bytes(self, page_size: int) -> int:
        """Bytes of one page of this buffer: ``row_bytes * page_size / tokens_per_row``.

        What SGLang calls a buffer's item length (``get_contiguous_buf_infos``: one token's
        bytes times ``page_size`` for token-major buffers, one row for page-major ones), the
        unit its KV transfer and host pools move.

        Args:
            page_size: tokens per page, > 0, a multiple of ``tokens_per_row``.
        Raises:
            ArgumentError: ``page_size`` is not such an int.
        """
        int_arg("page_size", page_size, lo=1, unit="tokens")
        if page_size % self.tokens_per_row:
            raise ArgumentError(
                "page_size", page_size,
                f"a multiple of tokens_per_row ({self.tokens_per_row}) for buffer "
                f"{self.name!r}: a page must be whole rows")
        return self.row_bytes * (page_size // self.tokens_per_row)


_DESC_FIELDS = ("name", "shape", "row_bytes", "tokens_per_row")


def _as_desc(i: int, d: object) -> KvBufferDesc:
    """One of SGLang's descriptor objects (or anything with its four fields) as ours."""
    if isinstance(d, KvBufferDesc):
        return d
    missing = [f for f in _DESC_FIELDS if not hasattr(d, f)]
    if missing:
        raise ArgumentError(f"buffer_descs[{i}]", d,
                            "a KvBufferDesc: an object with name, shape, row_bytes and "
                            "tokens_per_row", f"it has no {', '.join(missing)}")
    shape: Any = d.shape  # type: ignore[attr-defined]
    if isinstance(shape, list):  # a tuple (torch.Size is one) passes as is; ints checked there
        shape = tuple(shape)
    return KvBufferDesc(d.name, shape, d.row_bytes, d.tokens_per_row)  # type: ignore[attr-defined]


def _cuda_ordinal(device: object, device_id: int) -> bool:
    """True when ``device`` names a CUDA device; a ``cuda:N`` must agree with ``device_id``."""
    text = str(device)
    if text != "cuda" and not text.startswith("cuda:"):
        return False
    if text.startswith("cuda:") and text[5:] != str(device_id):
        raise ArgumentError("device", device, f"'cuda' or 'cuda:{device_id}', as device_id says")
    return True


class KvVmmBufferOwner:
    """SGLang's KV buffer owner: tensors at their upper-bound shapes, backed as SGLang asks.

    Args:
        device: ``"cuda"`` or ``"cuda:<device_id>"`` (kvvmm's CUDA driver is opened on
            ``device_id``); with ``driver=`` any string, only recorded.
        device_id: the device ordinal.
        store_dtype: the KV dtype (a torch dtype or its name).
        page_size: tokens per page, > 0.
        reserved_num_tokens: the most tokens ``finalize`` may serve, in ``[page_size, what
            the descriptors hold]``.
        buffer_descs: SGLang's descriptors (``name``, ``shape``, ``row_bytes``,
            ``tokens_per_row``), K buffers first; ``tensors`` follow their order.
        driver: a kvvmm driver to run on instead of opening CUDA's (kvvmm extension; the
            caller keeps it and closes it). Default: the one :func:`install` was given,
            else CUDA's.
        granularity: with CUDA's driver, the mapping unit: ``"recommended"`` (default, as
            SGLang 0.5.23 asks), ``"minimum"`` (the seed's), or bytes.
        handle_type: with CUDA's driver, what its handles are shareable as: ``"auto"``
            (default: probed as SGLang 0.5.23 does), ``"posix_fd"``, ``"fabric"`` or
            ``"none"`` (the seed's); ``driver.handle_type`` says what it got.
        policy: growth policy for ``ensure_prefix`` (kvvmm extension; default ``Exact()``,
            the seed's).
        name: the arena's name, shown by the lab.
    Raises:
        ArgumentError, OutOfRangeError, UnknownDtypeError (``ValueError``/``TypeError``):
            bad arguments or descriptors; nothing reserved.
        KvVmmError (``RuntimeError``): no CUDA here, or reserving/backing slot 0 failed;
            nothing left behind.
    """

    def __init__(
        self,
        *,
        device: str,
        device_id: int,
        store_dtype: Any,
        page_size: int,
        reserved_num_tokens: int,
        buffer_descs: Sequence[Any],
        driver: Driver | None = None,
        policy: GrowthPolicy | None = None,
        name: str = "kv",
        granularity: str | int = "recommended",
        handle_type: str = "auto",
    ) -> None:
        self.device = device
        int_arg("device_id", device_id, lo=0, limit="an int >= 0 (a device ordinal)")
        if not isinstance(handle_type, str) or handle_type not in _HANDLE_TYPES:
            raise ArgumentError("handle_type", handle_type,
                                f"one of {list(_HANDLE_TYPES)} ('auto': as SGLang 0.5.23 picks)")
        self.device_id = device_id
        self.store_dtype = store_dtype
        self.page_size = page_size
        if isinstance(buffer_descs, (str, bytes)) or not isinstance(buffer_descs, Sequence):
            raise ArgumentError("buffer_descs", buffer_descs, "a sequence of KvBufferDesc")
        descs = [_as_desc(i, d) for i, d in enumerate(buffer_descs)]
        with _sglang_errors():
            if driver is None:
                driver = _installed_driver
            self._owns_driver = driver is None
            if driver is None:
                if not _cuda_ordinal(device, device_id):
                    raise ArgumentError(
                        "device", device, "'cuda' or 'cuda:<device_id>'",
                        "pass driver=kvvmm.open_driver('host' | 'sim') to run elsewhere")
                driver = open_driver("cuda", device=device_id, granularity=granularity,
                                     handle_type=handle_type)
            self.driver: Driver = driver
            try:
                core_reserved = _core_reserved(descs, page_size, reserved_num_tokens)
                self.owner = KvBufferOwner(
                    driver=driver, device=device_id, dtype=store_dtype, page_size=page_size,
                    reserved_tokens=core_reserved, descs=descs,
                    policy=Exact() if policy is None else policy, name=name)
            except BaseException:
                if self._owns_driver:
                    driver.close()
                raise
        self.buffer_descs: tuple[KvBufferDesc, ...] = tuple(descs)
        self._reserved_num_tokens: int = reserved_num_tokens

    def __repr__(self) -> str:
        return f"KvVmmBufferOwner(device={self.device!r}, {self.owner!r})"

    # -- the seed's API -------------------------------------------------------------------

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The KV tensors in ``buffer_descs`` order (empty after close), pointers fixed."""
        return self.owner.tensors

    @property
    def reserved_num_tokens(self) -> int:
        """What SGLang passed (the seed keeps it as given; ``finalize`` is bounded by it)."""
        return self._reserved_num_tokens

    def ensure_prefix(self, num_tokens: int) -> None:
        """Back the first ``num_tokens`` slots of every buffer.

        Args:
            num_tokens: ``0 <= num_tokens <= reserved_num_tokens + page_size`` (the top
                page included, as SGLang's lazy caller asks), and at most the slots the
                tensors hold.
        Raises:
            ArgumentError, OutOfRangeError (``ValueError``): bad ``num_tokens``; nothing
                backed.
            KvVmmError (``RuntimeError``): a driver call failed (every buffer as it was), or
                after close.
        """
        with _sglang_errors():
            self.owner.ensure_prefix(num_tokens)

    def finalize(self, final_num_tokens: int) -> None:
        """Back each buffer's final span for ``final_num_tokens`` (plus the padded page).

        Args:
            final_num_tokens: ``page_size <= n <= reserved_num_tokens``, and its final span
                (``n + page_size`` slots) must fit the tensors, as the seed's span check says.
        Raises:
            ArgumentError, OutOfRangeError (``ValueError``): bad ``n``; nothing backed.
            KvVmmError (``RuntimeError``): a driver call failed (every buffer as it was), or
                after close.
        """
        with _sglang_errors():
            n = final_num_tokens
            if is_int(n):
                if n > self._reserved_num_tokens:
                    raise OutOfRangeError("final_num_tokens", n,
                                          f"<= reserved_num_tokens ({self._reserved_num_tokens})")
                top = self.owner.reserved_tokens
                if n > top:
                    raise OutOfRangeError(
                        "final_num_tokens", n, f"<= {top}",
                        f"its final span, n + page_size ({self.owner.page_size}) slots, must "
                        f"fit the tensors, which hold {top + self.owner.page_size}")
            self.owner.finalize(n)

    @property
    def final_num_tokens(self) -> int | None:
        """The serving capacity ``finalize`` set (None before it)."""
        return self.owner.final_tokens

    @property
    def backed_bytes(self) -> int:
        """Bytes backed across all buffers, whole handles (0 after close)."""
        return self.owner.backed_bytes

    def close(self, *, wait: bool = False, timeout: float | None = None) -> bool:
        """Drop the tensors and give the memory back once no tensor can reach it.

        Idempotent. Tensors the caller still holds keep the memory until they go (the seed
        unmapped it under them).

        Args:
            wait: block until the memory is given back (tensors held elsewhere must be
                dropped by other code meanwhile; reference cycles are collected first).
            timeout: seconds to wait at most (None: no limit); only with ``wait``.
        Returns:
            :attr:`released`: True when the memory is given back.
        Raises:
            BusyError (``RuntimeError``): ``wait`` and tensors were still alive after
                ``timeout``; the owner stays closed and gives its memory back later.
            KvVmmError (``RuntimeError``): a driver call failed giving memory back.
        """
        if timeout is not None:  # None: no limit; NaN or inf would never end the wait
            timeout = seconds_arg("timeout", timeout, none=True)
        with _sglang_errors():
            self.owner.close()
            if wait and not self.released:
                self._wait_released(timeout)
            if self.released and self._owns_driver:
                self.driver.close()
        return self.released

    def _wait_released(self, timeout: float | None) -> None:
        gc.collect()  # tensors in reference cycles (graphs, pools) go only when collected
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.released:
            if deadline is not None and time.monotonic() >= deadline:
                raise BusyError(
                    f"close(wait=True, timeout={timeout}): tensors over arena "
                    f"{self.owner.arena.name!r} still alive after {timeout} s: "
                    f"{self.live_tensors}; "
                    "drop them (the pool's buffers, captured graphs' inputs) and the memory "
                    "is given back when the last goes")
            time.sleep(0.005)

    @property
    def released(self) -> bool:
        """True once the reservation and all its memory are given back to the driver."""
        return self.owner.arena.released

    @property
    def live_tensors(self) -> int:
        """Tensors (and views) over the arena still alive: what a close waits for."""
        return self.owner.arena.live_views

    # -- later upstream calls -------------------------------------------------------------

    def release_beyond(self, num_tokens: int) -> int:
        """Give back backing beyond the first ``num_tokens`` slots of every buffer.

        As upstream's lazy-backing owner: each buffer keeps ``rows(n) * row_bytes``
        (rounded up to whole mappings) and gives back every mapping that starts at or past
        it; a mapping straddling that span stays (maps are whole handles).
        :meth:`KvBufferOwner.release_beyond`; ``shrink`` (which keeps the padded page too)
        stays on :attr:`owner`.

        Args:
            num_tokens: ``page_size <= n <= reserved_num_tokens`` (slot 0's page stays).
        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError (``ValueError``): bad ``n``; nothing changed.
            KvVmmError (``RuntimeError``): a driver call failed (see
                :meth:`KvBufferOwner.shrink_report`), or after close.
        """
        with _sglang_errors():
            return self.owner.release_beyond(num_tokens)

    def bytes_per_token(self) -> int:
        """Bytes one token slot takes across all buffers: sum of ``ceil(row_bytes /
        tokens_per_row)`` (upstream's rounding)."""
        return sum(-(-d.row_bytes // d.tokens_per_row) for d in self.buffer_descs)

    @property
    def backed_tokens(self) -> int:
        """The most tokens usable with nothing more to back (0 after close), O(1).

        The largest ``n`` for which ``ensure_prefix(n)`` would back nothing
        (:attr:`KvBufferOwner.backed_tokens`), up to ``reserved_num_tokens + page_size``:
        SGLang's lazy caller reads it on every allocation.
        """
        return self.owner.backed_tokens

    # -- release / resume memory occupation (SGLang's memory saver) ---------------------

    def pause(self, *, backup: str | None = None, path: Any = None) -> int:
        """Give every physical byte back, keeping the tensors' pointers and captured graphs.

        What SGLang's ``release_memory_occupation`` asks of its KV pool
        (``memory_saver_adapter.pause("kv_cache")``): :meth:`KvBufferOwner.sleep`. SGLang
        flushes its radix cache right after, so the default drops the bytes, as
        torch_memory_saver's KV region does (``enable_cpu_backup=False``).

        Args:
            backup: None (default), ``"host"`` (pinned host memory) or ``"disk"`` (``path``).
            path: the new file for ``backup="disk"``.
        Returns:
            Bytes given back (the pool's idle handles included).
        Raises:
            ArgumentError (``ValueError``): bad ``backup`` or ``path``; nothing changed.
            KvVmmError (``RuntimeError``): refused (asleep already, a graph capture), or the
                copy-out or a driver call failed: the owner is awake with its bytes.
        """
        with _sglang_errors():
            res = self.owner.sleep(backup, path=path)
        return res.given_bytes + res.pool_bytes

    def resume(self) -> int:
        """Back every range :meth:`pause` gave back (same VA), bytes copied back if kept.

        Returns:
            Bytes backed again.
        Raises:
            KvVmmError (``RuntimeError``): not paused, a capture underway, or a create, map
                or copy failed: the owner stays paused with its backup; call again later.
        """
        with _sglang_errors():
            return self.owner.wake()

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self.owner.asleep

    # -- for the lab ----------------------------------------------------------------------

    @property
    def arena(self) -> Any:
        """The kvvmm arena (``kvvmm.arena.Arena``) the buffers live in."""
        return self.owner.arena

    def snapshot(self) -> OwnerSnapshot:
        """Frozen view of the owner now: what ``kvvmm.viz.describe`` and ``va_map`` draw."""
        return self.owner.snapshot()


#: SGLang's tag for its KV cache (``sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE``).
KV_CACHE_TAG = "kv_cache"


class KvVmmMemorySaver:
    """SGLang's memory-saver adapter, with the KV cache's pause/resume done by kvvmm.

    SGLang's ``release_memory_occupation`` / ``resume_memory_occupation`` (its scheduler's
    weight updater, 0.5.23) call ``memory_saver_adapter.pause(tag)`` / ``resume(tag)`` per
    tag (``"kv_cache"``, ``"weights"``, ``"cuda_graph"``) on a ``TorchMemorySaverAdapter``.
    This object answers the same calls: the ``"kv_cache"`` tag sleeps / wakes every
    :class:`KvVmmBufferOwner` registered under it (hybrid SWA has two), every owner or none;
    every other tag (and ``region``, ``cuda_graph``, ``configure_subprocess``,
    ``disable``) goes to ``inner``, the adapter SGLang made, when given.

    Args:
        inner: the ``TorchMemorySaverAdapter`` to forward other tags to (None: they do
            nothing, as SGLang's no-op adapter).
        cpu_backup: keep the KV bytes in pinned host memory while paused (torch_memory_saver's
            ``enable_cpu_backup``); default False: SGLang flushes its cache after the pause.
    """

    def __init__(self, inner: Any = None, *, cpu_backup: bool = False) -> None:
        bool_arg("cpu_backup", cpu_backup)
        self.inner = inner
        self.cpu_backup = cpu_backup
        self._owners: dict[str, list[KvVmmBufferOwner]] = {}

    def register(self, owner: KvVmmBufferOwner, tag: str = KV_CACHE_TAG) -> None:
        """Pause and resume ``owner`` with ``tag`` (idempotent)."""
        if not isinstance(owner, KvVmmBufferOwner):
            raise ArgumentError("owner", owner, "a KvVmmBufferOwner")
        if not isinstance(tag, str) or not tag:
            raise ArgumentError("tag", tag, "a non-empty str (SGLang's: 'kv_cache')")
        owners = self._owners.setdefault(tag, [])
        if owner not in owners:
            owners.append(owner)

    def owners(self, tag: str = KV_CACHE_TAG) -> tuple[KvVmmBufferOwner, ...]:
        return tuple(self._owners.get(tag, ()))

    @property
    def enabled(self) -> bool:
        return bool(self._owners) or bool(getattr(self.inner, "enabled", False))

    def pause(self, tag: str | None = None) -> None:
        """Pause ``tag`` (None: every tag): its owners all sleep, or none does.

        Every owner is asked first (:meth:`Arena.sleep_refusal
        <kvvmm.arena.Arena.sleep_refusal>`): one that would refuse (paused already, closed,
        a graph capture) refuses the whole call before any owner or the inner adapter
        changes. An owner registered under several tags sleeps once.

        Raises:
            KvVmmError (``RuntimeError``): an owner refused (nothing changed) or failed, or
                the inner adapter failed: the owners paused by this call were resumed again
                (the notes say so, and name any whose resume failed).
        """
        owners = self._pick(tag)
        self._refuse_unless_all(owners, "sleep", f"pause({tag!r})")
        done: list[KvVmmBufferOwner] = []
        try:
            for o in owners:
                try:
                    o.pause(backup="host" if self.cpu_backup else None)
                finally:
                    if o.paused:  # a release failing past every unmap: the sleep stood
                        done.append(o)
            if self.inner is not None and (tag is None or tag not in self._owners):
                self.inner.pause(tag)
        except BaseException as e:
            for d in reversed(done):
                try:
                    d.resume()
                except Exception as e2:
                    e.add_note(f"resuming {d.arena.name!r} again also failed: {e2}")
            e.add_note(f"KvVmmMemorySaver.pause({tag!r}): {len(done)} owner(s) paused by "
                       f"this call were resumed again")
            raise

    def resume(self, tag: str | None = None) -> None:
        """Resume ``tag`` (None: every tag): its owners all wake, or none stays awake.

        Every owner is asked first: one that would refuse (not paused, closed, a graph
        capture) refuses the whole call before the inner adapter or any owner changes.

        Raises:
            KvVmmError (``RuntimeError``): an owner refused (nothing changed), or an owner's
                wake failed (out of memory): the owners woken before it paused again (with a
                host backup where theirs kept bytes) and the inner adapter paused again;
                every owner is paused, retry later.
        """
        owners = self._pick(tag)
        self._refuse_unless_all(owners, "wake", f"resume({tag!r})")
        inner = self.inner is not None and (tag is None or tag not in self._owners)
        if inner:
            self.inner.resume(tag)
        done: list[tuple[KvVmmBufferOwner, str | None]] = []
        for o in owners:
            kept = "host" if o.arena.sleep_backup is not None else None
            try:
                o.resume()
            except BaseException as e:
                for d, how in reversed(done):
                    try:
                        d.pause(backup=how)
                    except Exception as e2:
                        e.add_note(f"pausing {d.arena.name!r} again also failed: {e2}")
                if inner:
                    try:
                        self.inner.pause(tag)
                    except Exception as e2:
                        e.add_note(f"pausing the inner adapter's {tag!r} again also "
                                   f"failed: {e2}")
                e.add_note(f"KvVmmMemorySaver.resume({tag!r}): {len(done)} owner(s) "
                           f"resumed before the failure were paused again")
                raise
            done.append((o, kept))

    def _pick(self, tag: str | None) -> list[KvVmmBufferOwner]:
        """The owners of ``tag`` (None: of every tag), each once, in registration order."""
        groups = (self._owners.values() if tag is None else
                  [self._owners[tag]] if tag in self._owners else [])
        out: list[KvVmmBufferOwner] = []
        for owners in groups:
            out += [o for o in owners if not any(o is x for x in out)]
        return out

    @staticmethod
    def _refuse_unless_all(owners: Sequence[KvVmmBufferOwner], what: str, call: str) -> None:
        """Raise the first refusal a ``what`` (``"sleep"`` or ``"wake"``) of any of
        ``owners`` would meet, before anything changes."""
        with _sglang_errors():
            for o in owners:
                why = o.arena.sleep_refusal(what)  # ClosedError after close
                if why is not None:
                    raise SleepRefusedError(f"KvVmmMemorySaver.{call}: {why}; no owner "
                                            f"changed")

    # -- the rest of TorchMemorySaverAdapter: the inner adapter's, or nothing ----------

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        """The inner adapter's region (kvvmm owners need none: register them instead)."""
        if self.inner is None:
            yield
            return
        with self.inner.region(tag, enable_cpu_backup=enable_cpu_backup):
            yield

    def __getattr__(self, name: str) -> Any:  # cuda_graph, configure_subprocess, disable...
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(inner, name)


def _core_reserved(descs: Sequence[KvBufferDesc], page_size: object,
                   reserved_num_tokens: object) -> int | None:
    """The core owner's ``reserved_tokens`` for SGLang's ``reserved_num_tokens``.

    The seed bounds ``reserved_num_tokens`` only by what the tensors hold: SGLang's unified
    pool passes all of it (``total_bytes`` one-byte rows, page 1), one slot more than
    finalize can serve with its padded page. The core owner serves at most ``holds -
    page_size``; the rest of SGLang's bound is kept by the adapter (``finalize``).
    """
    r = reserved_num_tokens
    if not is_int(r) or not descs or not is_int(page_size) or page_size <= 0:
        return r  # type: ignore[return-value]  # the core owner names what is wrong
    holds = min(d.shape[0] * d.tokens_per_row for d in descs)
    if r > holds:
        raise OutOfRangeError("reserved_num_tokens", r, f"at most {holds}",
                              "the token slots the descs' tensors hold "
                              "(shape[0] * tokens_per_row, the least over the buffers)")
    return None if r > holds - page_size else r


# -- install ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstallResult:
    """What :func:`install` did, and why."""

    #: "installed": SGLang's import will resolve to kvvmm; "already": it did before;
    #: "replaced": SGLang had imported the seed already: later imports get kvvmm, names
    #: bound from the seed before stay the seed's.
    status: Literal["installed", "already", "replaced"]
    module: str  #: the module name aliased
    sglang_installed: bool  #: whether ``sglang`` is importable here

    def __str__(self) -> str:
        where = "" if self.sglang_installed else " (sglang is not installed here)"
        return f"{self.module} -> {__name__}: {self.status}{where}"


_previous: dict[str, types.ModuleType | None] = {}
#: The driver :func:`install` was given: owners SGLang builds (no ``driver=``) run on it.
_installed_driver: Driver | None = None


def install(module: str = SGLANG_MODULE, *, driver: Driver | None = None) -> InstallResult:
    """Make SGLang's ``import ...kv_vmm_backing`` resolve to this module.

    Puts this module in ``sys.modules`` under SGLang's name (and on its parent package when
    that is imported), so ``from sglang.srt.mem_cache.kv_vmm_backing import
    KvVmmBufferOwner`` gets kvvmm's class. Call it before SGLang builds its KV pool:

    - sglang not imported yet (or not installed): the alias waits in ``sys.modules``; Python
      finds it there first and never loads the seed (nothing of sglang is imported here).
    - the seed already imported: the alias replaces it for later imports; a class bound
      from the seed before (``from ... import KvVmmBufferOwner`` at module level) stays
      the seed's, so a ``RuntimeWarning`` says so (call ``install()`` earlier).
    - already installed: nothing changes.

    ``sys.modules`` is per process: SGLang's spawned workers need the call too. Running
    SGLang as ``python -m kvvmm.integrations.sglang_launch sglang.launch_server ...`` does
    that (spawned children re-import the launcher, which installs at import).

    Args:
        module: the module name to alias (SGLang's, by default).
        driver: a kvvmm driver every owner SGLang builds runs on (its calls pass no
            ``driver=``), e.g. ``kvvmm.open_driver("host")`` to drive SGLang's own pools on
            a machine without a GPU (give them ``device="cpu:0"``). The caller keeps and
            closes it; None (default): each owner opens CUDA's on its ``device_id``.
            :func:`uninstall` forgets it.
    Returns:
        What was done (:class:`InstallResult`).
    """
    global _installed_driver
    if not isinstance(module, str) or not module:
        raise ArgumentError("module", module, "a dotted module name")
    if driver is not None:
        check_driver(driver)
    _installed_driver = driver
    me = sys.modules[__name__]
    top = module.partition(".")[0]
    try:
        present = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        present = False
    current = sys.modules.get(module)
    if current is me:
        return InstallResult("already", module, present)
    _previous.setdefault(module, current)
    sys.modules[module] = me
    parent_name, _, leaf = module.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is not None:
        setattr(parent, leaf, me)
    if current is None:
        return InstallResult("installed", module, present)
    warnings.warn(
        f"{module} was imported before kvvmm's install(): later imports get kvvmm's "
        f"KvVmmBufferOwner, names already bound from the seed keep the seed's; call "
        f"install() before SGLang is imported", RuntimeWarning, stacklevel=2)
    return InstallResult("replaced", module, present)


def uninstall(module: str = SGLANG_MODULE) -> bool:
    """Undo :func:`install`: put back what ``sys.modules`` held before. True if it did."""
    global _installed_driver
    _installed_driver = None
    me = sys.modules[__name__]
    if sys.modules.get(module) is not me:
        return False
    before = _previous.pop(module, None)
    parent_name, _, leaf = module.rpartition(".")
    parent = sys.modules.get(parent_name)
    if before is None:
        del sys.modules[module]
        if parent is not None and getattr(parent, leaf, None) is me:
            delattr(parent, leaf)
    else:
        sys.modules[module] = before
        if parent is not None:
            setattr(parent, leaf, before)
    return True
