"""The ledger file as untrusted input: links, owners and modes, forks, truncation, a held lock,
hostile names and values, credits past what is booked.

Whoever may write the file can deny service to the tenants sharing it; nothing they write may
crash a tenant, make it write outside the file, book past the budget unseen, or print raw
bytes to a terminal. Calls that could hang or fault run in a forked child whose exit code the
test reads (a SIGBUS or a hang is a failure, not the end of the test session).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import select
import signal
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvvmm.budget import (
    BudgetExceededError,
    BudgetSnapshot,
    FaultyLedger,
    ForeignTenantError,
    Ledger,
    LedgerCorruptError,
    LedgerError,
    LedgerLockTimeoutError,
    LedgerUntrustedError,
    Tenant,
    TenantInfo,
)
from kvvmm.budget.ledger_file import (
    BACKED,
    FILE_BYTES,
    H_BUDGET,
    H_MAGIC,
    H_SEQ,
    H_SLOTS,
    H_VERSION,
    LIMIT,
    NAME_BYTES,
    NAMES,
    PID,
    SERIAL,
    SHED,
    STATE,
)
from kvvmm.cli import main as cli_main
from kvvmm.cli.budget import format_snapshot
from kvvmm.errors import ArgumentError, ClosedError, OutOfRangeError

MiB = 1 << 20
PAGE = 4096


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ledger"


def _in_child(fn: Callable[[], object], timeout_s: float = 20.0) -> tuple[int, str]:
    """Run ``fn`` in a forked child; return its exit status (-signal when killed, -999 when
    it hung past ``timeout_s``) and what it returned, as text (or the error it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            out = str(fn())
        except BaseException as e:
            out, code = f"raised {type(e).__name__}: {e}", 1
        with contextlib.suppress(BaseException):
            os.write(w, out.encode("utf-8", "replace")[:60000])
        os._exit(code)
    os.close(w)
    end = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return -999, "hung"
        time.sleep(0.005)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    code = os.waitstatus_to_exitcode(status)
    return code, b"".join(chunks).decode("utf-8", "replace")


def _poke(path: Path, word: int, value: int) -> None:
    """Write one 64-bit word of the file as a hostile writer would: no lock, no checks."""
    with open(path, "r+b") as f:
        f.seek(word * 8)
        f.write(value.to_bytes(8, "little"))


def _poke_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# -- links, owners and modes ------------------------------------------------------------------


@pytest.mark.parametrize("target", ["absent", "a file", "a ledger"])
def test_a_link_at_the_ledgers_path_is_refused_and_its_target_left_as_it_was(
        tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]) -> None:
    aim = tmp_path / "aim"
    if target == "a file":
        aim.write_bytes(b"precious\n")
    elif target == "a ledger":
        Ledger(aim, budget_bytes=64 * MiB).close()
    before = aim.read_bytes() if aim.exists() else None
    link = tmp_path / "ledger"
    link.symlink_to(aim)
    for opener in (lambda: Ledger(link, budget_bytes=64 * MiB), lambda: Ledger(link)):
        with pytest.raises(LedgerUntrustedError, match="symbolic link"):
            opener()
    assert cli_main(["budget", "init", "1GiB", "--ledger", str(link)]) == 2
    assert cli_main(["budget", "show", "--ledger", str(link)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert (aim.read_bytes() if aim.exists() else None) == before
    assert link.is_symlink()


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_folder_others_could_swap_the_ledger_out_of_is_refused_before_anything_is_made(
        tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(LedgerUntrustedError, match="folder"):
        Ledger(folder / "ledger", budget_bytes=64 * MiB)
    assert list(folder.iterdir()) == []
    folder.chmod(mode | stat.S_ISVTX)  # sticky: only the file's owner may remove or rename it
    Ledger(folder / "ledger", budget_bytes=64 * MiB).close()


def test_a_ledger_file_that_is_not_one_regular_file_of_one_name_is_refused(
        tmp_path: Path) -> None:
    led = tmp_path / "ledger"
    Ledger(led, budget_bytes=64 * MiB).close()
    os.link(led, tmp_path / "second-name")
    with pytest.raises(LedgerUntrustedError, match="hard links"):
        Ledger(led)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    for opener in (lambda: Ledger(fifo), lambda: Ledger(fifo, budget_bytes=64 * MiB)):
        with pytest.raises(LedgerUntrustedError, match="regular file"):
            opener()
    with pytest.raises(LedgerUntrustedError, match="regular file"):
        Ledger(tmp_path, budget_bytes=64 * MiB)


@pytest.mark.parametrize("mode", [0o602, 0o606, 0o666, 0o620, 0o660])
def test_a_ledger_others_may_write_is_refused(path: Path, mode: int) -> None:
    Ledger(path, budget_bytes=64 * MiB).close()
    path.chmod(mode)
    before = path.read_bytes()
    for opener in (lambda: Ledger(path), lambda: Ledger(path, budget_bytes=64 * MiB)):
        with pytest.raises(LedgerUntrustedError, match="may write it"):
            opener()
    assert path.read_bytes() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file takes root")
def test_a_ledger_another_user_owns_is_refused_unless_shared_through_a_named_group(
        path: Path) -> None:
    Ledger(path, budget_bytes=64 * MiB).close()
    os.chown(path, 65534, os.getegid())  # nobody's file
    path.chmod(0o600)
    with pytest.raises(LedgerUntrustedError, match="owned by uid 65534"):
        Ledger(path)
    path.chmod(0o660)  # its group may write it: trusted through that group only
    with pytest.raises(LedgerUntrustedError):
        Ledger(path)
    with Ledger(path, group=os.getegid()) as led:
        led.register("member").close()
    path.chmod(0o666)  # every user may write it: never trusted
    with pytest.raises(LedgerUntrustedError, match="every user"):
        Ledger(path, group=os.getegid())


def test_a_group_shared_ledger_is_made_0660_in_that_group(path: Path) -> None:
    gid = os.getegid()
    with Ledger(path, budget_bytes=64 * MiB, group=gid) as led:
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, gid)
        led.register("t").close()
    with pytest.raises(LedgerUntrustedError, match="group"):
        Ledger(path)  # group-writable, and no group named
    with pytest.raises(ArgumentError):
        Ledger(path, group="no-such-group-here")


# -- fork -------------------------------------------------------------------------------------


def test_a_forks_child_cannot_use_its_parents_tenant_and_registers_a_slot_of_its_own(
        path: Path) -> None:
    with Ledger(path, budget_bytes=64 * MiB) as led:
        parent = led.register("parent")
        parent.charge(8 * MiB)

        def child() -> str:
            refused = []
            for name, call in (("charge", lambda: parent.charge(PAGE)),
                               ("credit", lambda: parent.credit(PAGE)),
                               ("poll", parent.poll), ("backed", lambda: parent.backed_bytes),
                               ("room", parent.room_bytes), ("close", parent.close)):
                try:
                    call()
                except ForeignTenantError:
                    refused.append(name)
            own = led.register("child")
            own.charge(4 * MiB)
            return json.dumps({"refused": refused, "slot": own.slot,
                               "backed": own.backed_bytes, "parent_slot": parent.slot})

        code, out = _in_child(child)
        assert code == 0, out
        got = json.loads(out)
        assert got["refused"] == ["charge", "credit", "poll", "backed", "room", "close"]
        assert got["slot"] != got["parent_slot"] and got["backed"] == 4 * MiB
        assert parent.backed_bytes == 8 * MiB  # the child booked nothing to the parent
        assert {t.name for t in led.snapshot().tenants} == {"parent"}  # the child is gone
        parent.credit(8 * MiB)
        parent.close()


def test_fork_children_charging_at_once_never_book_past_the_budget(path: Path) -> None:
    """Children of a parent that opened the ledger and registered before fork: whatever
    they try (the parent's tenant, their own through the inherited Ledger), the pages they
    book together never pass the budget, round after round."""
    budget = 256 * PAGE
    children = 4
    for _ in range(12):
        if path.exists():
            path.unlink()
        with Ledger(path, budget_bytes=budget) as led:
            parent = led.register("parent")
            go_r, go_w = os.pipe()
            done_r, done_w = os.pipe()  # apart from "go": a fast child must not take two
            pipes, pids = [], []
            for i in range(children):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    booked = 0
                    try:
                        os.close(r)
                        os.read(go_r, 1)
                        tenants: list[Tenant] = [parent]
                        with contextlib.suppress(LedgerError, ArgumentError):
                            tenants.append(led.register(f"child{i}"))
                        for _ in range(budget // PAGE + 1):
                            for t in tenants:
                                with contextlib.suppress(LedgerError, BudgetExceededError):
                                    t.charge(PAGE, wait_s=0)
                                    booked += PAGE
                        os.write(w, str(booked).encode())
                        os.read(done_r, 1)  # stay registered until the parent has looked
                    finally:
                        os._exit(0)
                os.close(w)
                pipes.append(r)
                pids.append(pid)
            os.write(go_w, b"x" * children)
            end = time.monotonic() + 60  # every child answers, or the test fails
            while True:
                ready, _, _ = select.select(pipes, [], [], max(end - time.monotonic(), 0))
                if len(ready) == len(pipes) or time.monotonic() >= end:
                    break
                time.sleep(0.002)
            if len(ready) < len(pipes):
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                pytest.fail("a fork's child hung")
            booked = [int(os.read(r, 64) or b"0") for r in pipes]
            seen = led.snapshot().backed_bytes
            os.write(done_w, b"x" * children)
            for pid in pids:
                os.waitpid(pid, 0)
            for fd in (*pipes, go_r, go_w, done_r, done_w):
                os.close(fd)
            assert sum(booked) <= budget and seen <= budget, (booked, seen)
            assert parent.backed_bytes == 0
            parent.close()


# -- truncation ------------------------------------------------------------------------------


def _every_call(led: Ledger, t: Tenant) -> list[tuple[str, Callable[[], object]]]:
    return [
        ("charge", lambda: t.charge(PAGE)), ("poll", t.poll),
        ("backed", lambda: t.backed_bytes), ("limit", lambda: t.limit_bytes),
        ("room", t.room_bytes), ("snapshot", led.snapshot), ("sweep", led.sweep),
        ("ledger backed", led.backed_bytes), ("budget", lambda: led.budget_bytes),
        ("set_limit", lambda: led.set_limit("victim", MiB)),
        ("set_budget", lambda: led.set_budget(MiB)), ("register", lambda: led.register("new")),
        ("close", t.close), ("open", lambda: Ledger(led.path)),
    ]


@pytest.mark.parametrize("size", [0, 100, NAMES, FILE_BYTES - 8, FILE_BYTES + 4096])
def test_a_ledger_truncated_under_its_tenants_is_refused_by_every_call_never_a_sigbus(
        path: Path, size: int) -> None:
    def victim() -> str:
        led = Ledger(path, budget_bytes=64 * MiB)
        t = led.register("victim")
        t.charge(2 * MiB)
        os.truncate(path, size)  # another process would do the same through its own fd
        untyped = []
        for name, call in _every_call(led, t):
            try:
                call()
                untyped.append(f"{name}: accepted")
            except LedgerCorruptError:
                pass
            except Exception as e:
                untyped.append(f"{name}: {type(e).__name__}: {e}")
        t.credit(2 * MiB)  # a credit never fails the release: it waits in the tenant
        if t.pending_credit_bytes != 2 * MiB:
            untyped.append(f"credit: {t.pending_credit_bytes} waiting")
        return "; ".join(untyped)

    code, out = _in_child(victim)
    assert code == 0 and out == "", (code, out)  # -7 is SIGBUS
    assert path.stat().st_size == size  # nothing was written into the corrupt file


# -- a held lock ------------------------------------------------------------------------------


@contextlib.contextmanager
def _lock_held(path: Path) -> Iterator[None]:
    """This process holds the ledger's lock through an open file of its own."""
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def test_a_held_lock_times_out_typed_naming_the_path_the_wait_and_the_holder(
        path: Path) -> None:
    def victim() -> str:
        led = Ledger(path, budget_bytes=64 * MiB)
        t = led.register("victim")
        led.lock_timeout_s = 0.1
        patient = Ledger(path)
        mine = patient.register("patient")
        patient.lock_timeout_s = 60.0  # a charge's own wait bounds its wait for the lock
        r, w = os.pipe()
        me = os.getpid()
        holder = os.fork()
        if holder == 0:  # takes the lock and keeps it until killed (or orphaned)
            fd = os.open(path, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(w, b"x")
            while os.getppid() == me:
                time.sleep(0.05)
            os._exit(0)
        try:
            os.read(r, 1)
            wrong = []
            calls = _every_call(led, t)[:-1]
            calls.append(("open", lambda: Ledger(path, lock_timeout_s=0.1)))
            calls.append(("charge", lambda: mine.charge(PAGE, wait_s=0.1)))
            for name, call in calls:
                try:
                    call()
                    wrong.append(f"{name}: accepted")
                except LedgerLockTimeoutError as e:
                    if str(path) not in str(e) or "0.1 s" not in str(e) \
                            or f"pid {holder}" not in str(e) or e.wait_s != 0.1:
                        wrong.append(f"{name}: {e}")
                except Exception as e:
                    wrong.append(f"{name}: {type(e).__name__}: {e}")
            return "; ".join(wrong)
        finally:
            os.kill(holder, signal.SIGKILL)
            os.waitpid(holder, 0)

    code, out = _in_child(victim, timeout_s=30)
    assert code == 0 and out == "", (code, out)


def test_budget_show_waits_for_a_held_lock_a_bounded_time_and_names_its_holder(
        path: Path) -> None:
    Ledger(path, budget_bytes=64 * MiB).close()

    def show(*extra: str) -> str:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli_main(["budget", "show", "--ledger", str(path), *extra])
        return json.dumps([code, err.getvalue()])

    with _lock_held(path):
        for extra in ((), ("--lock-timeout", "0.2")):
            code, out = _in_child(lambda e=extra: show(*e), timeout_s=30)  # type: ignore[misc]
            assert code == 0, out
            status, err = json.loads(out)
            assert status == 2 and f"pid {os.getpid()}" in err and len(err.splitlines()) == 1


# -- names ---------------------------------------------------------------------------------


_HOSTILE_NAMES = ["a\nb", "\x1b[31mred", "tab\there", "cr\r", "del\x7f", "\x9bcsi",
                  "rtl\u202eevil", "zero\u200bwidth", "nbsp\xa0", "line\u2028sep", " lead",
                  "trail ", "lone\ud800", "bell\a"]


@pytest.mark.parametrize("name", _HOSTILE_NAMES)
def test_a_name_a_terminal_would_act_on_is_refused_at_registration(path: Path,
                                                                   name: str) -> None:
    with Ledger(path, budget_bytes=64 * MiB) as led:
        with pytest.raises(ArgumentError) as e:
            led.register(name)
        assert e.value.name == "name"
        assert "\n" not in str(e.value) and "\x1b" not in str(e.value)
        assert led.snapshot().tenants == ()


@pytest.mark.parametrize("name", _HOSTILE_NAMES[:10])
def test_budget_show_never_prints_a_name_raw(path: Path, name: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    info = TenantInfo(name=name, pid=1, alive=True, limit_bytes=MiB, backed_bytes=0,
                      shed_bytes=0, shed_left_s=0.0, shed_done_bytes=0)
    text = format_snapshot(BudgetSnapshot(f"/x/{name}", 64 * MiB, (info,)))
    assert len(text.splitlines()) == 3 and all(line.isprintable() for line in text.splitlines())
    # A name a hostile writer put in the file: refused as corrupt, in one printable line.
    with Ledger(path, budget_bytes=64 * MiB) as led:
        t = led.register("honest")
        raw = name.encode("utf-8", "surrogatepass")[:NAME_BYTES]
        _poke_bytes(path, NAMES + t.slot * NAME_BYTES, raw.ljust(NAME_BYTES, b"\0"))
        assert cli_main(["budget", "show", "--ledger", str(path)]) == 2
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.splitlines()) == 1 and out.err[:-1].isprintable()


# -- values out of range ---------------------------------------------------------------------


def _corruptions() -> list[tuple[str, Callable[[Path, int, int], None]]]:
    """(what, how): each writes into a ledger whose slot ``s`` is live (8 MiB booked) and
    whose slot ``f`` is free."""
    def word(index: Callable[[int, int], int], value: int) -> Callable[[Path, int, int], None]:
        return lambda p, s, f: _poke(p, index(s, f), value)

    def name(data: bytes, free: bool = False) -> Callable[[Path, int, int], None]:
        return lambda p, s, f: _poke_bytes(p, NAMES + (f if free else s) * NAME_BYTES,
                                           data.ljust(NAME_BYTES, b"\0"))

    return [
        ("budget 0", word(lambda s, f: H_BUDGET, 0)),
        ("budget 2^64-1", word(lambda s, f: H_BUDGET, 2**64 - 1)),
        ("budget 2^60", word(lambda s, f: H_BUDGET, 2**60)),
        ("magic", word(lambda s, f: H_MAGIC, 7)),
        ("version", word(lambda s, f: H_VERSION, 99)),
        ("slot count", word(lambda s, f: H_SLOTS, 65)),
        ("a reserved header word", word(lambda s, f: H_SEQ + 3, 1)),
        ("bytes booked in a free slot", word(lambda s, f: BACKED + f, 4 * MiB)),
        ("a pid in a free slot", word(lambda s, f: PID + f, 1)),
        ("a shed request in a free slot", word(lambda s, f: SHED + f, PAGE)),
        ("a name in a free slot", name(b"ghost", free=True)),
        ("a state of 7", word(lambda s, f: STATE + s, 7)),
        ("booked 2^60", word(lambda s, f: BACKED + s, 2**60)),
        ("a limit of 2^64-1", word(lambda s, f: LIMIT + s, 2**64 - 1)),
        ("asked to shed more than booked", word(lambda s, f: SHED + s, 16 * MiB)),
        ("a live pid of 0", word(lambda s, f: PID + s, 0)),
        ("a pid past pid_max", word(lambda s, f: PID + s, 2**40)),
        ("a serial of 0", word(lambda s, f: SERIAL + s, 0)),
        ("a serial past the change counter", word(lambda s, f: SERIAL + s, 2**40)),
        ("a name with a newline", name(b"a\nb")),
        ("a name that is not UTF-8", name(b"\xff\xfe")),
        ("a name with a NUL inside", name(b"a\0b")),
        ("an empty live name", name(b"")),
    ]


@pytest.mark.parametrize(("what", "corrupt"), _corruptions(), ids=[c[0] for c in _corruptions()])
def test_a_ledger_value_out_of_range_is_refused_by_every_call_and_nothing_is_written(
        path: Path, what: str, corrupt: Callable[[Path, int, int], None],
        capsys: pytest.CaptureFixture[str]) -> None:
    led = Ledger(path, budget_bytes=64 * MiB)
    t = led.register("victim")
    t.charge(8 * MiB)
    corrupt(path, t.slot, t.slot + 1)
    before = path.read_bytes()
    wrong = []
    for name, call in _every_call(led, t):
        try:
            call()
            wrong.append(f"{name}: accepted")
        except LedgerCorruptError:
            pass
    assert wrong == []
    assert cli_main(["budget", "show", "--ledger", str(path)]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    assert path.read_bytes() == before  # refused before anything was written
    led.close()


def test_two_live_tenants_of_one_name_are_refused_as_corrupt(path: Path) -> None:
    with Ledger(path, budget_bytes=64 * MiB) as led:
        a, b = led.register("a"), led.register("b")
        _poke_bytes(path, NAMES + b.slot * NAME_BYTES, b"a".ljust(NAME_BYTES, b"\0"))
        with pytest.raises(LedgerCorruptError, match="two live slots"):
            led.snapshot()
        with pytest.raises(LedgerCorruptError):
            a.charge(PAGE)


# -- slots belong to the tenant that registered them ------------------------------------------


def test_a_slot_another_process_rewrote_is_never_charged_or_credited_by_its_old_tenant(
        path: Path) -> None:
    with Ledger(path, budget_bytes=64 * MiB) as led, Ledger(path) as other:
        old = led.register("old")
        old.charge(8 * MiB)
        for col in range(STATE, NAMES // 8, 64):  # a hostile writer frees the slot
            _poke(path, col + old.slot, 0)
        _poke_bytes(path, NAMES + old.slot * NAME_BYTES, bytes(NAME_BYTES))
        new = other.register("new")
        new.charge(4 * MiB)
        assert new.slot == old.slot
        for call in (lambda: old.charge(PAGE), lambda: old.credit(PAGE), old.poll,
                     lambda: old.backed_bytes):
            with pytest.raises(ForeignTenantError):
                call()
        assert new.backed_bytes == 4 * MiB
        old.close()  # nothing of it is left to free; the new tenant keeps its slot
        assert [x.name for x in led.snapshot().tenants] == ["new"]
        new.credit(4 * MiB)
        new.close()


def test_a_closed_tenants_credit_never_reaches_the_tenant_that_took_its_slot(
        path: Path) -> None:
    with Ledger(path, budget_bytes=64 * MiB) as led:
        old = led.register("old")
        old.close()
        new = led.register("new")
        new.charge(8 * MiB)
        with pytest.raises(ClosedError):
            old.credit(4 * MiB)
        assert new.backed_bytes == 8 * MiB
        new.credit(8 * MiB)
        new.close()


# -- credits ---------------------------------------------------------------------------------


def test_a_credit_of_more_than_the_tenant_books_is_refused_before_anything_changes(
        path: Path) -> None:
    with FaultyLedger(path, budget_bytes=64 * MiB) as led:
        t = led.register("t")
        t.charge(8 * MiB)
        for n in (8 * MiB + 1, 16 * MiB):
            with pytest.raises(OutOfRangeError) as e:
                t.credit(n)
            assert e.value.value == n and "8388608 bytes" in str(e.value)
        assert (t.backed_bytes, t.pending_credit_bytes) == (8 * MiB, 0)
        led.arm(fail={"credit": 1})
        t.credit(3 * MiB)  # the write fails: 3 MiB wait in the tenant
        assert (t.backed_bytes, t.pending_credit_bytes) == (8 * MiB, 3 * MiB)
        with pytest.raises(OutOfRangeError, match="at most the 5242880 bytes"):
            t.credit(5 * MiB + 1)  # with the waiting 3 MiB: more than it books
        assert (t.backed_bytes, t.pending_credit_bytes) == (8 * MiB, 3 * MiB)
        t.credit(5 * MiB)
        assert (t.backed_bytes, t.pending_credit_bytes) == (0, 0)
        for bad in (0, -1, True, False, 1.0, "1", None, 2**64, 2**4000):
            for call in (t.charge, t.credit, led.set_budget):
                with pytest.raises(ArgumentError):
                    call(bad)  # type: ignore[arg-type]
        assert t.backed_bytes == 0 and led.budget_bytes == 64 * MiB
        t.close()


@pytest.mark.parametrize("wait", [1e300, 1e12, 86400.5])
def test_a_wait_too_long_for_the_clock_is_refused_typed_and_the_file_stays_valid(
        path: Path, wait: float) -> None:
    with Ledger(path, budget_bytes=16 * MiB) as led:
        t = led.register("t")
        t.charge(16 * MiB)
        calls: list[Callable[[], object]] = [
            lambda: led.set_limit("t", 0, shed_wait_s=wait), lambda: t.charge(PAGE, wait_s=wait),
            lambda: led.set_budget(MiB, shed_wait_s=wait),
            lambda: led.register("u", shed_wait_s=wait),
            lambda: t.watch(lambda r: None, interval_s=wait),
            lambda: t.watch(lambda r: None, sweep_s=wait),
            lambda: Ledger(path, lock_timeout_s=wait)]
        for call in calls:
            with pytest.raises(ArgumentError):
                call()
        assert led.set_limit("t", 0, shed_wait_s=86400) == 16 * MiB  # a day: the longest
        assert t.poll() is not None and led.snapshot().budget_bytes == 16 * MiB
        t.credit(16 * MiB)
        t.close()


def test_a_ledger_whose_maker_died_before_its_magic_is_made_again_by_the_next_maker(
        path: Path) -> None:
    Ledger(path, budget_bytes=64 * MiB).close()
    _poke(path, H_MAGIC, 0)  # the maker wrote the rest of the header, then died
    _poke(path, H_BUDGET, 5)
    with pytest.raises(LedgerCorruptError, match="not a kvvmm budget ledger"):
        Ledger(path)  # without a budget: nothing to make it with
    with Ledger(path, budget_bytes=32 * MiB) as led:
        assert led.budget_bytes == 32 * MiB and led.snapshot().tenants == ()
