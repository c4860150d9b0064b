"""The ledger's file as untrusted input: opened safely, locked with a timeout, checked whole.

Anyone who can write the file can change what every tenant reads, so the file is input, not
shared state to believe (docs/BUDGET.md, "What the ledger file may be trusted for", is the
threat model): its folder checked, then the file opened with ``O_NOFOLLOW`` (``O_CREAT |
O_EXCL`` to create) and checked with ``fstat`` on the descriptor (:class:`LedgerFile`);
read whole with ``pread``, never mapped (a truncated mapping is SIGBUS in every process);
checked whole on every read (:func:`check_image`); written one 64-bit word at a time; locked
with ``flock`` polled up to a timeout (:class:`~kvvmm.budget.errors.LedgerLockTimeoutError`
names the holder).

Layout (64-bit words in the machine's byte order; docs/BUDGET.md draws it): a header of 16
words (magic, version, slot count, the GPU budget, a change counter, zeros), then one column
of ``SLOTS`` words per field, then ``SLOTS`` names of ``NAME_BYTES`` bytes.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import stat
import struct
import time
from pathlib import Path

from kvvmm.budget.errors import (
    LedgerCorruptError,
    LedgerError,
    LedgerLockTimeoutError,
    LedgerUntrustedError,
)
from kvvmm.checks import is_int
from kvvmm.errors import ArgumentError

__all__ = ["FILE_BYTES", "MAX_BYTES", "NAME_BYTES", "SLOTS", "LedgerFile", "check_image",
           "name_problem", "resolve_group"]

MAGIC = int.from_bytes(b"KVVMMBG1", "little")
VERSION = 2
#: tenants one ledger holds (one GPU rarely hosts more than a handful of engines)
SLOTS = 64
#: bytes of a tenant's name, UTF-8 (NUL-padded in the file)
NAME_BYTES = 64
#: the largest budget, limit or charge (64 PiB): sums of 64 of them stay exact in a u64
MAX_BYTES = 1 << 56
#: Linux's largest pid (PID_MAX_LIMIT)
PID_MAX = 1 << 22
#: clock values and counters: inside int64, as every honest writer leaves them
WORD_MAX = (1 << 63) - 1

# Header words (5 to 15 are reserved: zero).
H_MAGIC, H_VERSION, H_SLOTS, H_BUDGET, H_SEQ = 0, 1, 2, 3, 4
HEADER_WORDS = 16
# Columns, each SLOTS words.
_COLUMN_NAMES = ("state", "pid", "start ticks", "limit bytes", "backed bytes", "shed bytes",
                 "shed deadline", "bytes shed", "serial")
COLUMNS = len(_COLUMN_NAMES)
FREE, REGISTERING, LIVE = 0, 1, 2


def _col(c: int) -> int:
    return HEADER_WORDS + c * SLOTS


STATE, PID, START, LIMIT, BACKED, SHED, SHED_DL, SHED_DONE, SERIAL = (
    _col(c) for c in range(COLUMNS))
NAMES = (HEADER_WORDS + COLUMNS * SLOTS) * 8
FILE_BYTES = NAMES + SLOTS * NAME_BYTES
_WORD = struct.Struct("=Q")  # native order, as the image memoryview reads the words

# Lock polling: the lock is held for microseconds by an honest holder; start short, back off
# to at most this, so a waiter costs little CPU and still sees a free lock within 2 ms.
_BACKOFF_S = (50e-6, 2e-3)


def name_problem(raw: bytes) -> str | None:
    """Why ``raw`` (a name's UTF-8) is not a tenant name, or None when it is one.

    A name is printed by ``kvvmm budget show`` and in messages: 1 to ``NAME_BYTES`` bytes of
    UTF-8, printable characters only (no control, format or separator character: no
    newline, no terminal escape, no bidirectional override), no space at either end.
    """
    if not 1 <= len(raw) <= NAME_BYTES:
        return f"{len(raw)} bytes, not 1 to {NAME_BYTES}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    if not text.isprintable():
        return "holds a control, format or separator character"
    if text != text.strip():
        return "starts or ends with a space"
    return None


# One slot's words, column by column (a column is SLOTS words apart), in one unpack.
_SLOT = struct.Struct("=" + f"Q{SLOTS * 8 - 8}x" * (COLUMNS - 1) + "Q")
_HEADER = struct.Struct(f"={HEADER_WORDS}Q")
_FREE_FROM = (HEADER_WORDS + SLOTS) * 8  # the first byte after the state column
_ZEROS = bytes(FILE_BYTES)
# The last state column seen and what follows from it: the busy slots, and the byte ranges
# every free slot's words and names cover (adjacent ones merged), which must be zeros.
_LAST: tuple[bytes, list[int], list[tuple[int, int]]] = (b"", [], [])


def _free_ranges(states: bytes) -> tuple[list[int], list[tuple[int, int]]]:
    global _LAST
    last = _LAST
    if last[0] == states:
        return last[1], last[2]
    busy = [s for s in range(SLOTS) if any(states[s * 8:s * 8 + 8])]
    spans = sorted([((_col(c) + s) * 8, (_col(c) + s + 1) * 8)
                    for c in range(1, COLUMNS) for s in range(SLOTS) if s not in busy]
                   + [(NAMES + s * NAME_BYTES, NAMES + (s + 1) * NAME_BYTES)
                      for s in range(SLOTS) if s not in busy])
    ranges: list[tuple[int, int]] = []
    for a, b in spans:
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    _LAST = (states, busy, ranges)
    return busy, ranges


def check_image(path: str, data: bytes) -> None:
    """Check a whole ledger image as read from the file; every value is untrusted.

    Args:
        path: the file, for the message.
        data: what a read of ``FILE_BYTES + 1`` bytes returned.
    Raises:
        LedgerCorruptError: not a ledger of this version, truncated or grown, or a value out
            of its range (the message names the first such value).
    """
    def bad(what: str) -> LedgerCorruptError:
        return LedgerCorruptError(path, what)

    if len(data) != FILE_BYTES:
        raise bad(f"it has {len(data)}{'+' if len(data) > FILE_BYTES else ''} bytes where a "
                  f"ledger has {FILE_BYTES} (truncated or grown)")
    h = _HEADER.unpack_from(data)
    if h[H_MAGIC] != MAGIC or h[H_VERSION] != VERSION or h[H_SLOTS] != SLOTS:
        raise LedgerCorruptError(path, f"magic, version or slot count differ from a kvvmm "
                                       f"budget ledger of version {VERSION} with {SLOTS} slots",
                                 foreign=True)
    if not 1 <= h[H_BUDGET] <= MAX_BYTES:
        raise bad(f"its budget {h[H_BUDGET]} is not in [1, {MAX_BYTES}] bytes")
    seq = h[H_SEQ]
    if seq > WORD_MAX or any(h[H_SEQ + 1:]):
        raise bad("its header's change counter or reserved words are out of range")
    busy, ranges = _free_ranges(data[STATE * 8:_FREE_FROM])
    # A free slot holds zeros only: bytes booked there would lower the budget unseen.
    for a, b in ranges:
        if data[a:b] != _ZEROS[:b - a]:
            _free_slot_problem(path, data, busy)
    names: set[bytes] = set()
    for s in busy:
        st, pid, start, limit, backed, shed, *rest = _SLOT.unpack_from(data, (STATE + s) * 8)
        live = st == LIVE
        if st > LIVE:
            raise bad(f"slot {s}'s state is {st} (0 free, 1 registering, 2 live)")
        if not (1 if live else 0) <= pid <= PID_MAX:
            raise bad(f"slot {s}'s pid {pid} is not in [{1 if live else 0}, {PID_MAX}]")
        if limit > MAX_BYTES or backed > MAX_BYTES:
            raise bad(f"slot {s}'s limit {limit} or backed {backed} bytes pass {MAX_BYTES}")
        if shed > (backed if live else MAX_BYTES):
            raise bad(f"slot {s} is asked to shed {shed} bytes but backs {backed}")
        if max(start, *rest) > WORD_MAX:
            raise bad(f"slot {s}'s start ticks, shed deadline, bytes shed or serial pass "
                      f"{WORD_MAX}")
        if live and not 1 <= rest[-1] <= seq:
            raise bad(f"slot {s}'s serial {rest[-1]} is not in [1, the change counter {seq}]")
        at = NAMES + s * NAME_BYTES
        raw = data[at:at + NAME_BYTES].rstrip(b"\0")
        if raw or live:  # a slot being registered may not have its name yet
            why = "holds a NUL" if b"\0" in raw else name_problem(raw)
            if why is not None:
                raise bad(f"slot {s}'s name {raw!r} {why}")
            if live:
                if raw in names:
                    raise bad(f"two live slots are named {raw!r}")
                names.add(raw)


def _free_slot_problem(path: str, data: bytes, busy: list[int]) -> None:
    """Raise naming the first free slot's word (or name) that is not zero."""
    for s in range(SLOTS):
        if s in busy:
            continue
        words = _SLOT.unpack_from(data, (STATE + s) * 8)
        for c in range(1, COLUMNS):
            if words[c]:
                raise LedgerCorruptError(path, f"free slot {s} holds {_COLUMN_NAMES[c]} "
                                               f"{words[c]} (a free slot holds zeros)")
        if any(data[NAMES + s * NAME_BYTES:NAMES + (s + 1) * NAME_BYTES]):
            raise LedgerCorruptError(path, f"free slot {s} holds a name (a free slot holds "
                                           f"zeros)")
    raise AssertionError("the free-slot mask found a word no free slot holds")


def resolve_group(group: str | int | None) -> int | None:
    """The gid of ``group`` (a name or a gid), which this process must be a member of.

    Raises:
        ArgumentError: no such group, or this process is not in it.
    """
    if group is None:
        return None
    if not (isinstance(group, str) or is_int(group)):
        raise ArgumentError("group", group, "a group name, a gid or None")
    try:
        if isinstance(group, str):
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                if not group.isdigit():
                    raise
                gid = grp.getgrgid(int(group)).gr_gid  # a gid, as the command line gives it
        else:
            gid = grp.getgrgid(group).gr_gid
    except (KeyError, OverflowError, ValueError):
        raise ArgumentError("group", group, "a group of this machine") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ArgumentError("group", group, "a group this process is a member of")
    return gid


def _check_folder(path: Path, st: os.stat_result, gid: int | None) -> None:
    """The folder must be one nobody else can swap the ledger out of."""
    me = os.geteuid()
    shared = gid is not None and st.st_gid == gid
    if st.st_uid not in (me, 0) and not shared:
        raise LedgerUntrustedError(str(path), f"its folder is owned by uid {st.st_uid}, not "
                                              f"by this user (uid {me}) or root")
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not sticky:
        raise LedgerUntrustedError(str(path), "its folder is writable by every user and not "
                                              "sticky (anyone could replace the file)")
    if st.st_mode & stat.S_IWGRP and not sticky and not shared:
        raise LedgerUntrustedError(str(path), f"its folder is writable by group {st.st_gid} "
                                              f"and not sticky (pass that group to share it)")


def _check_file(path: Path, st: os.stat_result, gid: int | None) -> None:
    """The opened file must be a regular file of one name that only we (or the shared group)
    may write."""
    if not stat.S_ISREG(st.st_mode):
        raise LedgerUntrustedError(str(path), "it is not a regular file")
    if st.st_nlink != 1:
        raise LedgerUntrustedError(str(path), f"it has {st.st_nlink} names (hard links)")
    me = os.geteuid()
    shared = gid is not None and st.st_gid == gid
    if st.st_uid != me and not shared:
        raise LedgerUntrustedError(
            str(path), f"it is owned by uid {st.st_uid}, not by this user (uid {me})"
            + (f" nor shared through group {gid}" if gid is not None else ""))
    if st.st_mode & stat.S_IWOTH:
        raise LedgerUntrustedError(str(path), f"every user may write it (mode "
                                              f"{stat.S_IMODE(st.st_mode):o})")
    if st.st_mode & stat.S_IWGRP and not shared:
        raise LedgerUntrustedError(str(path), f"group {st.st_gid} may write it (mode "
                                              f"{stat.S_IMODE(st.st_mode):o}); pass "
                                              f"group= to share it through that group")


_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
_OPEN_TRIES = 8  # a file made and removed under us again and again is not waited out


class LedgerFile:
    """One open, trusted ledger file of this process: its descriptor, lock, reads, writes.

    Args:
        path: the file.
        create: create it (0600, or 0660 with ``gid``) when absent.
        gid: the group it may be shared through (:func:`resolve_group`), or None.
    Raises:
        LedgerUntrustedError: a link, not a regular file, or owned or writable by others.
        LedgerError: absent and ``create`` is False.
        OSError: the folder or the file cannot be opened.
    """

    def __init__(self, path: Path, *, create: bool, gid: int | None) -> None:
        self.path = path
        self.gid = gid
        self.created = False  #: this call made the file (empty)
        self._left: bytes | bytearray | None = None  # see leave()
        try:
            folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if create:
                raise
            raise LedgerError(f"no budget ledger at {str(path)!r}: its folder does not "
                              f"exist") from None
        try:
            _check_folder(path, os.fstat(folder), gid)
            self.fd = self._open_in(folder, create)
        finally:
            os.close(folder)
        try:
            st = os.fstat(self.fd)
            _check_file(path, st, gid)
        except BaseException:
            os.close(self.fd)
            raise
        self.ident = (st.st_dev, st.st_ino)

    def _open_in(self, folder: int, create: bool) -> int:
        name = self.path.name
        for _ in range(_OPEN_TRIES):
            try:
                return os.open(name, _OPEN, dir_fd=folder)
            except FileNotFoundError:
                if not create:
                    raise LedgerError(f"no budget ledger at {str(self.path)!r}: create it "
                                      f"with a budget (Ledger(path, budget_bytes=...) or "
                                      f"kvvmm budget init BYTES)") from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise LedgerUntrustedError(str(self.path), "it is a symbolic link "
                                                               "(never followed)") from None
                if e.errno in (errno.EISDIR, errno.ENXIO):  # a folder, a socket
                    raise LedgerUntrustedError(str(self.path),
                                               "it is not a regular file") from None
                raise
            try:
                fd = os.open(name, _OPEN | os.O_CREAT | os.O_EXCL,
                             0o660 if self.gid is not None else 0o600, dir_fd=folder)
            except FileExistsError:
                continue  # made (or a link planted) since: open what is there, checked
            self.created = True
            try:  # the mode and group asked, whatever the umask
                if self.gid is not None:
                    os.fchown(fd, -1, self.gid)
                os.fchmod(fd, 0o660 if self.gid is not None else 0o600)
            except BaseException:
                os.close(fd)
                os.unlink(name, dir_fd=folder)
                raise
            return fd
        raise LedgerError(f"ledger {str(self.path)!r}: a file there kept appearing and "
                          f"vanishing while it was opened ({_OPEN_TRIES} tries)")

    # -- the lock ------------------------------------------------------------------------

    def lock(self, timeout_s: float) -> None:
        """Take the file's lock, waiting at most ``timeout_s``.

        Raises:
            LedgerLockTimeoutError: still held by another open file when the wait ran out.
        """
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        deadline = time.monotonic() + timeout_s
        delay = _BACKOFF_S[0]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LedgerLockTimeoutError(str(self.path), timeout_s, self.holder())
            time.sleep(min(delay, left))
            delay = min(delay * 2, _BACKOFF_S[1])
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                continue

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def holder(self) -> str:
        """Who holds this file's lock, as far as ``/proc/locks`` says ("" when unknown)."""
        try:
            with open("/proc/locks", encoding="ascii", errors="replace") as locks:
                text = locks.read()
            st = os.fstat(self.fd)
        except OSError:
            return ""
        want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        pids = []
        for line in text.splitlines():
            f = line.split()
            if len(f) < 6 or f[1] != "FLOCK":
                continue  # another kind of lock, or a waiter ("->")
            try:
                major, minor, ino = f[5].split(":")
                if (int(major, 16), int(minor, 16), int(ino)) == want:
                    pids.append(int(f[4]))
            except ValueError:
                continue
        return ", ".join(_process(p) for p in pids)

    # -- reads and writes ------------------------------------------------------------------

    def read(self) -> memoryview:
        """The whole file, checked, as a writable image of 64-bit words (under the lock).

        Raises:
            LedgerCorruptError: see :func:`check_image`.
            OSError: the read failed.
        """
        data = os.pread(self.fd, FILE_BYTES + 1, 0)
        if data != self._left:
            check_image(str(self.path), data)
        return memoryview(bytearray(data)).cast("Q")

    def leave(self, image: memoryview | None) -> None:
        """What this process left in the file at the end of a call (``image``, checked when
        read and changed only by this call's own writes), or None when unknown (a call that
        failed part way). A read that finds the file byte for byte as this process left it
        is not checked again: nobody else wrote."""
        # The image's own buffer: the call that wrote it is over, nothing changes it now.
        self._left = None if image is None else image.obj  # type: ignore[assignment]

    def write_word(self, index: int, value: int) -> None:
        """Store one 64-bit word (under the lock)."""
        if os.pwrite(self.fd, _WORD.pack(value), index * 8) != 8:
            raise OSError(errno.EIO, f"short write to the ledger {str(self.path)!r}")

    def write_bytes(self, offset: int, data: bytes) -> None:
        """Store ``data`` at ``offset`` (a name; under the lock)."""
        if os.pwrite(self.fd, data, offset) != len(data):
            raise OSError(errno.EIO, f"short write to the ledger {str(self.path)!r}")

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def reopen(self) -> None:
        """Give this process its own open file of the same file (after ``fork``: the
        child shared the parent's, and with it the parent's lock) and close the shared one.

        Raises:
            LedgerError: the file cannot be reopened, or it is not the same file.
        """
        old = self.fd
        try:
            fd = os.open(f"/proc/self/fd/{old}", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as e:
            raise LedgerError(f"ledger {str(self.path)!r}: this fork's child could not "
                              f"reopen it ({e}); open a Ledger in the child") from e
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.ident:
            os.close(fd)
            raise LedgerError(f"ledger {str(self.path)!r}: this fork's child reopened "
                              f"another file; open a Ledger in the child")
        self.fd = fd
        self._left = None
        os.close(old)  # never unlocked here: the lock is the parent's to release

    def close(self) -> None:
        os.close(self.fd)


def _process(pid: int) -> str:
    """``pid N (comm)`` of a lock holder; its name escaped (another user chose it)."""
    if pid == os.getpid():
        return f"pid {pid} (this process)"
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            comm = f.read().strip().decode("utf-8", "replace")
    except OSError:
        return f"pid {pid}"
    return f"pid {pid} ({comm.encode('unicode_escape').decode('ascii')})"
