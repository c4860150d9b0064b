"""What every ``kvvmm`` command shares: its argument parser, sizes, numbers and ports on the
command line, output paths, and the one-line error.

Bad input (an argument, a trace, a file) is one line on stderr and exit code 2, found before
any work starts and in bounded time; whatever the user wrote is printed escaped.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from kvvmm.checks import number_arg
from kvvmm.errors import ArgumentError
from kvvmm.units import MAX_BYTES, parse_size

__all__ = ["HELP_COLUMNS", "MAX_LINE", "MAX_PATH_CHARS", "MAX_TOKENS", "MAX_TP", "CliParser",
           "HelpFormatter", "float_text", "help_columns", "int_type", "number_type", "one_line",
           "output_path", "parse_bytes", "path_type", "profile_line", "show", "size_type"]

#: Help is laid out for at most this many columns, however wide the terminal says it is.
HELP_COLUMNS = 100
#: The longest error line a command prints (a message quoting a huge input is cut).
MAX_LINE = 500
#: The most GPUs a tensor-parallel group spans, on the command line.
MAX_TP = 1024
#: The most tokens a token count on the command line names (a trillion: past any KV pool).
MAX_TOKENS = 1 << 40
#: The longest path taken (Linux's PATH_MAX).
MAX_PATH_CHARS = 4096
#: Longer numbers are refused before they are read: bounded work for any input.
_NUMBER_MAX_CHARS = 32
_INT_RE = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_NUMBER_RE = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*", re.ASCII)


def show(text: object) -> str:
    """``text`` for a message: every character a terminal would act on written as an escape
    (``\\x1b``, ``\\n``, ``\\u202e``), so no argument, path or name can move the cursor,
    recolour the screen or start a second line."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def profile_line(used: Mapping[str, object]) -> str:
    """The line a command prints first: which profile ran and whose figures it predicts
    with, from :func:`kvvmm.hardware.profile_summary`."""
    date = str(used["date"])
    when = "" if date == "not stated" else f", {date}"
    return (f"profile: {used['key']} ({used['card']}{when}; {show(used['path'])}); "
            f"{used['label']}")


def one_line(msg: str, limit: int = MAX_LINE) -> str:
    """``msg`` escaped (:func:`show`) and cut to ``limit`` characters: one line, always."""
    line = show(msg)
    if len(line) > limit:
        line = line[:limit] + f"... ({len(line):,} characters)"
    return line


def _err(cmd: str, msg: str) -> None:
    print(f"kvvmm {cmd}: error: {one_line(msg)}", file=sys.stderr)


def _refusal(e: ArgumentError) -> str:
    """An :class:`ArgumentError` as argparse shows it after ``argument --name:``."""
    value = repr(e.value) if isinstance(e.value, str) else str(e.value)
    if len(value) > 60:
        value = value[:57] + "..."
    return f"{value} is invalid: must be {e.limit}" + (f" ({e.detail})" if e.detail else "")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, at most :data:`HELP_COLUMNS` wide whatever ``COLUMNS`` says."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        if width is None:
            width = max(40, min(shutil.get_terminal_size().columns, HELP_COLUMNS) - 2)
        super().__init__(prog, indent_increment, max_help_position, width)


class CliParser(argparse.ArgumentParser):
    """argparse with kvvmm's rules: a bad argument is one escaped line and exit 2 (not the
    usage and then the error), and help fits :data:`HELP_COLUMNS` columns. Subcommands'
    parsers are of this class too (argparse makes them of the parent's)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        """Print one line naming the bad argument and exit 2."""
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} -h)\n")


@contextmanager
def help_columns() -> Iterator[None]:
    """``COLUMNS`` at most :data:`HELP_COLUMNS` while it lasts, for parsers that are not a
    :class:`CliParser` (the benchmarks' and calibrate's): their help fits as this one's."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(min(shutil.get_terminal_size().columns, HELP_COLUMNS))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920; plain ints are bytes; KiB/MiB/GiB/TiB and KB/MB/GB/TB,
    read exactly (:func:`kvvmm.units.parse_size`), at most :data:`kvvmm.units.MAX_BYTES`.

    Raises:
        argparse.ArgumentTypeError: not a size, or out of range (the message says which).
    """
    return size_type()(text)


def size_type(lo: int = 0, hi: int = MAX_BYTES) -> Callable[[str], int]:
    """An argparse ``type`` reading a size in ``[lo, hi]`` bytes (:func:`parse_size`)."""
    def size(text: str) -> int:
        try:
            return parse_size(text, lo=lo, hi=hi)
        except ArgumentError as e:
            raise argparse.ArgumentTypeError(_refusal(e)) from None
    return size


def int_type(lo: int, hi: int, what: str = "") -> Callable[[str], int]:
    """An argparse ``type`` reading an int in ``[lo, hi]`` (``what`` says what it counts)."""
    limit = f"an int in [{lo}, {hi}]" + (f" ({what})" if what else "")

    def integer(text: str) -> int:
        if (len(text) > _NUMBER_MAX_CHARS or not _INT_RE.fullmatch(text)
                or not lo <= int(text) <= hi):
            raise argparse.ArgumentTypeError(_refusal(ArgumentError("", text, limit)))
        return int(text)
    return integer


def number_type(lo: float, hi: float, what: str = "", *, lo_open: bool = False
                ) -> Callable[[str], float]:
    """An argparse ``type`` reading a finite number in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``); NaN, infinity and numbers past the bounds are refused."""
    limit = (f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
             + (f" ({what})" if what else ""))

    def number(text: str) -> float:
        if len(text) > _NUMBER_MAX_CHARS or not _NUMBER_RE.fullmatch(text):
            raise argparse.ArgumentTypeError(_refusal(ArgumentError("", text, limit)))
        value = float(text)
        try:
            return number_arg("", value, lo=lo, hi=hi, lo_open=lo_open, limit=limit)
        except ArgumentError:
            raise argparse.ArgumentTypeError(
                _refusal(ArgumentError("", text, limit))) from None
    return number


def path_type(text: str) -> str:
    """An argparse ``type`` for a path: 1 to :data:`MAX_PATH_CHARS` printable characters
    (whether it exists is the command's to say)."""
    if not text or len(text) > MAX_PATH_CHARS or not text.isprintable():
        raise argparse.ArgumentTypeError(_refusal(ArgumentError(
            "", text, f"a path of 1 to {MAX_PATH_CHARS} printable characters")))
    return text


def float_text(text: str) -> float:
    """An argparse ``type`` reading a float as Python writes one (NaN and infinity too: the
    command bounds the value and names the limit), refusing text too long to be a number."""
    if len(text) > _NUMBER_MAX_CHARS:
        raise argparse.ArgumentTypeError(_refusal(ArgumentError(
            "", text, f"a number of at most {_NUMBER_MAX_CHARS} characters")))
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(_refusal(ArgumentError("", text, "a number"))) from None


def output_path(text: str, suffixes: Sequence[str], *, option: str = "-o") -> Path:
    """Where a command will write: checked before any work, so a replay never runs a
    minute to fail on its output. A name without a suffix gets ``suffixes[0]``.

    Returns:
        The path that will be written (the one to name afterwards).
    Raises:
        ArgumentError: an unknown suffix, a folder that does not exist, or a folder where
            the file would go.
    """
    out = Path(text)
    if not text or not out.name:
        raise ArgumentError(option, text, "a file name")
    if out.is_dir():
        raise ArgumentError(option, text, "a file, not a folder")
    if not out.suffix:
        out = out.with_name(out.name + suffixes[0])
    if out.suffix.lower() not in suffixes:
        raise ArgumentError(option, text, f"a file ending in one of {list(suffixes)}")
    parent = out.parent
    if not parent.is_dir():
        raise ArgumentError(option, text, "a file in a folder that exists",
                            f"{show(parent)} is not a folder")
    if out.is_dir():
        raise ArgumentError(option, text, "a file, not a folder")
    return out
