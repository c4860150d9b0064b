"""Request traces: what a serving engine was asked, one frozen record per request.

Two formats load into the same :class:`Request` records:

- Azure's LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP a
  datetime such as ``2023-11-16 18:15:46.6805900``, 7 fractional digits), as published in the
  Azure Public Dataset (``AzureLLMInferenceTrace_conv.csv``: github.com/Azure/AzurePublicDataset,
  CC-BY 4.0; Patel et al., "Splitwise: Efficient generative LLM inference using phase
  splitting", ISCA 2024). kvvmm does not ship it: download it from there.
- JSONL: one object per line, ``{"arrival_s": 0.5, "prompt_tokens": 812, "output_tokens": 96,
  "prefix_id": "sys-a"}`` (``prefix_id`` optional: requests sharing one share a prompt prefix).

A bad row is refused whole with :class:`~kvvmm.errors.WorkloadFormatError` naming its row
(1-based, counting the header of a CSV as row 1, as a spreadsheet does) and the field.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvvmm.checks import is_int, is_number
from kvvmm.errors import WorkloadFormatError

__all__ = ["AZURE_COLUMNS", "AZURE_CONV_TRACE", "Request", "RequestStream", "Requests",
           "Workload", "find_trace", "load_azure_csv", "load_jsonl", "load_workload",
           "save_jsonl"]

#: The Azure trace's columns, in order.
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

#: Where a checkout finds Azure's conversation trace, from the folder next to the
#: repository's root (kvvmm's own setup keeps data there; the package never ships it).
AZURE_CONV_TRACE = Path("shared", "data", "azure-llm-inference-2023",
                        "AzureLLMInferenceTrace_conv.csv")


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace."""

    arrival_s: float  #: arrival, seconds from the trace's first request (>= 0)
    prompt_tokens: int  #: prompt (context) tokens, >= 1
    output_tokens: int  #: tokens generated, >= 1
    prefix_id: str | None = None  #: requests with one id share a prompt prefix; None: none


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests in arrival order, and where they came from."""

    requests: tuple[Request, ...]
    source: str  #: a path, or the generator and its seed

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    @property
    def count(self) -> int:
        """Requests in it (a :class:`RequestStream` may not know its own)."""
        return len(self.requests)

    @property
    def span_s(self) -> float:
        """The last arrival, seconds (0 for none): how far a replay's clock goes at least."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def first(self, seconds: float) -> Workload:
        """The requests arriving in the first ``seconds`` of the trace."""
        if not is_number(seconds) or seconds <= 0:
            raise WorkloadFormatError(
                f"seconds={_r(seconds)} is invalid: must be a finite number > 0")
        return Workload(tuple(r for r in self.requests if r.arrival_s < seconds),
                        f"{self.source} (first {seconds:g} s)")


@dataclass(frozen=True, slots=True)
class RequestStream:
    """Requests in arrival order, drawn as they are read rather than held: a week of
    traffic (millions of requests) replays in the memory of one request.

    Each iteration calls ``opener`` for a fresh iterator, so a stream is read once per
    strategy (and per band) and yields the same requests each time.
    """

    opener: Callable[[], Iterator[Request]]  #: a fresh iterator over the requests
    source: str  #: the generator and its seed, or a path
    span_s: float  #: arrivals lie in ``[0, span_s)`` (for progress; > the last arrival)
    count: int | None = None  #: requests in it, when known before reading it

    def __iter__(self) -> Iterator[Request]:
        return self.opener()


#: What a replay reads: requests held (:class:`Workload`) or drawn as read (:class:`RequestStream`).
Requests = Workload | RequestStream


def _int_field(row: int, field: str, text: object) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise WorkloadFormatError(
            f"row {row}: {field}={_r(text)} is invalid: must be an int >= 1 (tokens)") from None
    if value < 1:
        raise WorkloadFormatError(f"row {row}: {field}={value} is invalid: must be >= 1 (tokens)")
    return value


#: how much of an offending value an error message quotes (a 10**6-column header made one
#: 10.9 MB stderr line)
_QUOTE = 200


def _cut(text: str) -> str:
    """``text``, cut to :data:`_QUOTE` characters with its full length said."""
    return text if len(text) <= _QUOTE else f"{text[:_QUOTE]}... ({len(text):,} characters)"


def _r(value: object) -> str:
    """``repr(value)`` for a message, as :func:`_cut` leaves it."""
    return _cut(repr(value))


def _timestamp(row: int, text: str) -> datetime:
    # Python's fromisoformat takes at most 6 fractional digits; Azure writes 7 (100 ns).
    s = text.strip()
    if "." in s:
        head, frac = s.split(".", 1)
        s = f"{head}.{frac[:6]}"
    try:
        return datetime.fromisoformat(s)
    except ValueError:
        raise WorkloadFormatError(
            f"row {row}: TIMESTAMP={_r(text)} is invalid: must be a datetime such as "
            f"'2023-11-16 18:15:46.6805900'") from None


def load_azure_csv(path: str | os.PathLike[str]) -> Workload:
    """Load an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens).

    Arrivals are seconds after the first row's TIMESTAMP; rows must be in time order.

    Args:
        path: the CSV file.
    Returns:
        A :class:`Workload` in file order.
    Raises:
        WorkloadFormatError: a missing column, a bad value or a row out of time order,
            naming the row (the header is row 1) and the field.
        OSError: the file cannot be read.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(_rows(reader, path), None)
        if header is None or [h.strip() for h in header[:3]] != list(AZURE_COLUMNS):
            raise WorkloadFormatError(
                f"row 1: header {_r(header)} is invalid: must start with the columns "
                f"{', '.join(AZURE_COLUMNS)} (Azure's LLM inference trace format)")
        out: list[Request] = []
        t0: datetime | None = None
        last = 0.0
        row = 1
        for cells in _rows(reader, path):
            row += 1
            if not cells:
                continue
            if len(cells) < 3:
                missing = AZURE_COLUMNS[len(cells)]
                raise WorkloadFormatError(f"row {row}: {missing} is missing "
                                          f"(the row has {len(cells)} of 3 fields)")
            t = _timestamp(row, cells[0])
            t0 = t if t0 is None else t0
            if (t.tzinfo is None) != (t0.tzinfo is None):
                raise WorkloadFormatError(
                    f"row {row}: TIMESTAMP={_r(cells[0])} is invalid: must "
                    f"{'have' if t0.tzinfo else 'not have'} a time zone, as the first row "
                    f"does (naive and zoned times cannot be ordered)")
            arrival = (t - t0).total_seconds()
            if arrival < last:
                raise WorkloadFormatError(
                    f"row {row}: TIMESTAMP={_r(cells[0])} is invalid: must not be before the "
                    f"row above it ({last:.6f} s after the first row; this one is {arrival:.6f})")
            last = arrival
            out.append(Request(arrival, _int_field(row, "ContextTokens", cells[1]),
                               _int_field(row, "GeneratedTokens", cells[2])))
    return Workload(tuple(out), os.fspath(path))


def _rows(reader: Any, path: str | os.PathLike[str]) -> Iterator[list[str]]:
    """The reader's rows; a field past csv's limit (128 KiB) or a malformed row becomes a
    WorkloadFormatError naming the row (``reader.line_num``)."""
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise WorkloadFormatError(
                f"row {reader.line_num}: not a CSV row of the trace ({_cut(str(e))})"
            ) from None
        yield cells


def load_jsonl(path: str | os.PathLike[str]) -> Workload:
    """Load requests from JSONL: one object per line (``arrival_s``, ``prompt_tokens``,
    ``output_tokens``, optional ``prefix_id``); blank lines are skipped.

    Raises:
        WorkloadFormatError: a line that is not a JSON object, a missing or bad field, an
            unknown field, or arrivals out of order, naming the line (row, from 1) and field.
        OSError: the file cannot be read.
    """
    out: list[Request] = []
    last = 0.0
    with open(path, encoding="utf-8") as f:
        for row, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line, parse_constant=_no_constant)
            except json.JSONDecodeError as e:
                raise WorkloadFormatError(f"row {row}: not JSON ({e.msg})") from None
            except RecursionError:
                raise WorkloadFormatError(f"row {row}: not a request object (JSON nested too "
                                          f"deeply to read)") from None
            except ValueError as e:  # NaN / Infinity literals: not JSON
                raise WorkloadFormatError(f"row {row}: not JSON ({e})") from None
            if not isinstance(obj, dict):
                raise WorkloadFormatError(f"row {row}: {_r(obj)} is invalid: must be a JSON object")
            unknown = sorted(set(obj) - {"arrival_s", "prompt_tokens", "output_tokens",
                                         "prefix_id"})
            if unknown:
                raise WorkloadFormatError(f"row {row}: unknown field {_r(unknown[0])} (fields: "
                                          f"arrival_s, prompt_tokens, output_tokens, prefix_id)")
            for field in ("arrival_s", "prompt_tokens", "output_tokens"):
                if field not in obj:
                    raise WorkloadFormatError(f"row {row}: {field} is missing")
            a = obj["arrival_s"]
            if not is_number(a) or a < 0:
                raise WorkloadFormatError(
                    f"row {row}: arrival_s={_r(a)} is invalid: must be a number >= 0 (seconds)")
            if a < last:
                raise WorkloadFormatError(
                    f"row {row}: arrival_s={_r(a)} is invalid: must be >= the row above's ({last})")
            last = float(a)
            toks = []
            for field in ("prompt_tokens", "output_tokens"):
                v = obj[field]
                if not is_int(v) or v < 1:
                    raise WorkloadFormatError(
                        f"row {row}: {field}={_r(v)} is invalid: must be an int >= 1 (tokens)")
                toks.append(v)
            pid = obj.get("prefix_id")
            if pid is not None and not isinstance(pid, str):
                raise WorkloadFormatError(
                    f"row {row}: prefix_id={_r(pid)} is invalid: must be a string or null")
            out.append(Request(float(a), toks[0], toks[1], pid))
    return Workload(tuple(out), os.fspath(path))


def _no_constant(name: str) -> object:
    # json.loads calls this for NaN / Infinity; load_jsonl adds the row (except ValueError).
    raise WorkloadFormatError(f"{name} is not a JSON number")


def save_jsonl(requests: Iterable[Request], path: str | os.PathLike[str]) -> None:
    """Write requests as JSONL that :func:`load_jsonl` reads back."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj: dict[str, object] = {"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                                      "output_tokens": r.output_tokens}
            if r.prefix_id is not None:
                obj["prefix_id"] = r.prefix_id
            f.write(json.dumps(obj) + "\n")


def load_workload(path: str | os.PathLike[str]) -> Workload:
    """Load a trace by its suffix: ``.csv`` (Azure format) or ``.jsonl``/``.json`` (JSONL).

    Raises:
        WorkloadFormatError: an unknown suffix, or a bad row (see the loaders).
        OSError: the file cannot be read.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        return load_azure_csv(path)
    if suffix in (".jsonl", ".json", ".ndjson"):
        return load_jsonl(path)
    raise WorkloadFormatError(f"trace {os.fspath(path)!r}: unknown format {_r(suffix)} "
                              f"(must be .csv, Azure's format, or .jsonl)")


def find_trace(path: str | os.PathLike[str] | None = None, *,
               start: str | os.PathLike[str] = ".") -> Path | None:
    """The trace file to run: ``path`` when given, else Azure's conversation trace next to
    the repository ``start`` lies in, else None (run a generated workload instead).

    The repository's root is the first folder from ``start`` up that holds ``.git`` or a
    ``pyproject.toml``; the trace is looked for at :data:`AZURE_CONV_TRACE` under the
    folder above it (``../shared/data/...`` of the root). Nothing is downloaded.

    Args:
        path: a trace a user names (``.csv`` or ``.jsonl``); it must be a file.
        start: where to look for the repository from (a notebook's folder).
    Returns:
        The path, or None when ``path`` is not given and no copy is there.
    Raises:
        WorkloadFormatError: ``path`` is given but is not a file.
    """
    if path is not None and os.fspath(path) != "":
        p = Path(path).expanduser()
        if not p.is_file():
            raise WorkloadFormatError(f"trace {os.fspath(path)!r} is not a file: give the path "
                                      f"of an Azure CSV or a JSONL trace")
        return p
    here = Path(start).resolve()
    for folder in (here, *here.parents):
        if (folder / ".git").exists() or (folder / "pyproject.toml").is_file():
            found = folder.parent / AZURE_CONV_TRACE
            return found if found.is_file() else None
    return None


def as_workload(requests: Workload | Sequence[Request], source: str = "requests") -> Workload:
    """A :class:`Workload` from one, or from requests in arrival order."""
    if isinstance(requests, Workload):
        return requests
    return Workload(tuple(requests), source)


def as_requests(requests: Requests | Sequence[Request], source: str = "requests") -> Requests:
    """A :class:`Workload` or :class:`RequestStream` as it is; a sequence as a Workload."""
    if isinstance(requests, RequestStream):
        return requests
    return as_workload(requests, source)
