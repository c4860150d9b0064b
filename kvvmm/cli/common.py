"""What every ``kvvmm`` command shares: sizes on the command line, the one-line error."""

from __future__ import annotations

import argparse
import re
import sys

from kvvmm.units import GiB, KiB, MiB, TiB

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920; plain ints are bytes; KiB/MiB/GiB/TiB and KB/MB/GB/TB.

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: use bytes (85899345920) or a unit (80GiB, 512MiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _err(cmd: str, msg: str) -> None:
    # One line, whatever the message holds (a hostile trace's text may carry newlines).
    one_line = msg.replace("\r", "\\r").replace("\n", "\\n")
    print(f"kvvmm {cmd}: error: {one_line}", file=sys.stderr)
