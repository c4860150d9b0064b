"""Synthetic workloads, seeded and deterministic, fitted to Azure's conversation trace.

The defaults (:func:`azure_conv_fit`) come from ``data/azure_conv_2023.json`` beside this
module: statistics computed by :func:`fit_workload` from ``AzureLLMInferenceTrace_conv.csv``
(Azure Public Dataset, 2023-11-16 18:15:46 to 19:14:08, 19,366 requests; CC-BY 4.0; Patel et
al., "Splitwise", ISCA 2024). The trace itself is not shipped: only these summaries are.

What the fit says (computed from the file, and checked in the tests against it):

- arrivals: 5.53 requests/s over 3,501.7 s; inter-arrival gaps have a coefficient of variation
  of 1.09 (Poisson: 1.0), and the rate drifts over the hour (1,128 to 2,192 requests per
  5 minutes): modelled as a Poisson process whose rate follows the trace's 12 five-minute bins;
- context (prompt) tokens: median 1,020, p99 4,142, max 14,050 (mean 1,155); far from lognormal
  (p25 396 and p75 1,189 cluster around the median), so it is sampled from the trace's 101
  percentiles (0, 1, ..., 100), linearly interpolated (an empirical inverse CDF);
- generated (output) tokens: median 129, p99 601, max 1,000 (mean 211), sampled the same way;
- context and output are drawn independently: their log-correlation in the trace is 0.09.

The fit is of one hour: it has no daily or weekly shape. A longer span repeats the hour's
five-minute rate profile (``generate_stream(duration_s=7 * 86400)`` is 168 such hours); a
week the size of Azure's published 2024 conversation week (about 27 M requests, a fleet's)
is ``rate_scale=`` :data:`AZURE_2024_WEEK_SCALE`. :func:`generate_stream` draws the requests
as they are read (the same requests as :func:`generate` for the same arguments), so a week
is never held.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvvmm.checks import int_arg, is_int, number_arg
from kvvmm.errors import ArgumentError, OutOfRangeError
from kvvmm.workload.requests import Request, RequestStream, Workload

__all__ = ["AZURE_2024_WEEK_REQUESTS", "AZURE_2024_WEEK_SCALE", "MAX_REQUESTS",
           "MAX_STREAM_S", "WorkloadFit", "azure_conv_fit", "fit_workload", "generate",
           "generate_stream", "percentile"]

#: The most requests one generate() call draws (or is expected to): a hundred times the real
#: trace's hour (19,366), ~200 MB of requests. A duration past it is refused before drawing
#: (a typo such as 1e12 seconds ran the host out of memory).
MAX_REQUESTS = 2_000_000
#: The longest span a stream draws, seconds: a year (a stream holds no request, so only
#: the time to replay it bounds it; a typo such as 1e12 is still refused).
MAX_STREAM_S = 366 * 86400.0
#: Conversation requests in Azure's published week of 2024 (AzurePublicDataset,
#: ``AzureLLMInferenceTrace_conv_1week``), about: a fleet's traffic, not one engine's.
AZURE_2024_WEEK_REQUESTS = 27_000_000
#: ``rate_scale`` that makes the fitted hour's rate (5.53/s) a week of
#: :data:`AZURE_2024_WEEK_REQUESTS` (about 44.6/s): 8.07.
AZURE_2024_WEEK_SCALE = 8.07


@dataclass(frozen=True, slots=True)
class WorkloadFit:
    """A trace summarised: what :func:`generate` draws from."""

    name: str
    source: str  #: where the statistics were computed from
    requests: int  #: requests in the fitted trace
    duration_s: float  #: first to last arrival
    rate_per_s: float  #: mean arrival rate
    gap_cv: float  #: coefficient of variation of inter-arrival gaps (Poisson: 1)
    rate_bin_s: float  #: width of a rate-profile bin
    rate_profile: tuple[float, ...]  #: arrival rate per bin relative to the mean (mean 1.0)
    context_percentiles: tuple[float, ...]  #: prompt tokens at percentiles 0, 1, ..., 100
    output_percentiles: tuple[float, ...]  #: output tokens at percentiles 0, 1, ..., 100

    def summary(self) -> dict[str, float]:
        """The headline figures: rate, and median / p99 / max of context and output."""
        c, o = self.context_percentiles, self.output_percentiles
        return {"rate_per_s": round(self.rate_per_s, 3), "context_median": c[50],
                "context_p99": c[99], "context_max": c[100], "output_median": o[50],
                "output_p99": o[99], "output_max": o[100]}

    def to_json(self) -> dict[str, Any]:
        return {"format": "kvvmm-workload-fit", "version": 1, "name": self.name,
                "source": self.source, "requests": self.requests,
                "duration_s": self.duration_s, "rate_per_s": self.rate_per_s,
                "gap_cv": self.gap_cv, "rate_bin_s": self.rate_bin_s,
                "rate_profile": list(self.rate_profile),
                "context_percentiles": list(self.context_percentiles),
                "output_percentiles": list(self.output_percentiles)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadFit:
        if data.get("format") != "kvvmm-workload-fit":
            raise ArgumentError("fit", data.get("format"), "a 'kvvmm-workload-fit' JSON object")
        return cls(str(data["name"]), str(data["source"]), int(data["requests"]),
                   float(data["duration_s"]), float(data["rate_per_s"]), float(data["gap_cv"]),
                   float(data["rate_bin_s"]), tuple(float(x) for x in data["rate_profile"]),
                   tuple(float(x) for x in data["context_percentiles"]),
                   tuple(float(x) for x in data["output_percentiles"]))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of sorted values, linear between ranks (numpy's default)."""
    if not sorted_values:
        raise ArgumentError("values", [], "a non-empty sequence")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def fit_workload(workload: Workload, *, name: str = "fit",
                 rate_bin_s: float = 300.0) -> WorkloadFit:
    """Summarise a trace into a :class:`WorkloadFit` (how the shipped defaults were made).

    Args:
        workload: at least two requests.
        name: the fit's name.
        rate_bin_s: width of the arrival-rate profile's bins, seconds > 0.
    """
    reqs = workload.requests
    if len(reqs) < 2:
        raise ArgumentError("workload", len(reqs), "at least 2 requests to fit")
    if not rate_bin_s > 0:
        raise ArgumentError("rate_bin_s", rate_bin_s, "> 0 (seconds)")
    t = [r.arrival_s - reqs[0].arrival_s for r in reqs]
    dur = t[-1]
    gaps = [b - a for a, b in itertools.pairwise(t)]
    mean_gap = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean_gap) ** 2 for g in gaps) / len(gaps))
    bins = max(1, round(dur / rate_bin_s))
    width = dur / bins if dur > 0 else rate_bin_s
    counts = [0] * bins
    for x in t:
        counts[min(int(x / width), bins - 1) if dur > 0 else 0] += 1
    mean_count = len(t) / bins
    ctx = sorted(r.prompt_tokens for r in reqs)
    out = sorted(r.output_tokens for r in reqs)
    return WorkloadFit(
        name=name, source=workload.source, requests=len(reqs), duration_s=round(dur, 6),
        rate_per_s=len(reqs) / dur if dur > 0 else float(len(reqs)),
        gap_cv=sd / mean_gap if mean_gap > 0 else 0.0, rate_bin_s=width,
        rate_profile=tuple(round(c / mean_count, 6) for c in counts),
        context_percentiles=tuple(percentile(ctx, q) for q in range(101)),
        output_percentiles=tuple(percentile(out, q) for q in range(101)))


@functools.cache
def azure_conv_fit() -> WorkloadFit:
    """The shipped fit of Azure's 2023 conversation trace (read once, on first use)."""
    text = resources.files("kvvmm.workload").joinpath("data/azure_conv_2023.json").read_text(
        encoding="utf-8")
    return WorkloadFit.from_json(json.loads(text))


def _sampler(pcts: Sequence[float], rng: random.Random) -> int:
    u = rng.random() * 100.0
    i = min(int(u), 99)
    v = pcts[i] + (pcts[i + 1] - pcts[i]) * (u - i)
    return max(1, round(v))


def _checked(fit: WorkloadFit | None, seed: int, duration_s: float | None,
             requests: int | None, rate_scale: float, prefixes: int, prefix_tokens: int,
             max_requests: float) -> tuple[WorkloadFit, float | None]:
    """The fit and the span, every argument checked (``max_requests``: the most a span may
    be expected to draw)."""
    f = azure_conv_fit() if fit is None else fit
    int_arg("seed", seed, limit="an int")
    number_arg("rate_scale", rate_scale, lo=0, hi=1e6, lo_open=True, limit="a number in (0, 1e6]")
    if requests is not None and (not is_int(requests) or not 1 <= requests <= max_requests):
        raise ArgumentError("requests", requests, f"an int in [1, {max_requests:,.0f}] or None")
    if duration_s is None and requests is None:
        duration_s = f.duration_s
    if duration_s is not None:
        number_arg("duration_s", duration_s, lo=0, lo_open=True,
                   limit="a finite number > 0 (seconds) or None")
    if duration_s is not None:  # what it would draw, before drawing it
        expected = f.rate_per_s * rate_scale * duration_s
        if expected > max_requests:
            raise OutOfRangeError("duration_s", duration_s,
                                  f"at most {max_requests:,.0f} requests expected at "
                                  f"{f.rate_per_s * rate_scale:g} per second (it would draw "
                                  f"about {expected:,.0f}); shorten it or lower rate_scale")
    for name, v in (("prefixes", prefixes), ("prefix_tokens", prefix_tokens)):
        int_arg(name, v, lo=0, limit="an int >= 0")
    return f, duration_s


def _draw(f: WorkloadFit, seed: int, duration_s: float | None, requests: int | None,
          rate_scale: float, prefixes: int, prefix_tokens: int) -> Iterator[Request]:
    """The requests, one at a time in arrival order (:func:`generate` and
    :func:`generate_stream` both read this)."""
    rng = random.Random(seed)
    edges = [0.0]
    for r in f.rate_profile:  # cumulative expected arrivals at each bin's end (one cycle)
        edges.append(edges[-1] + max(r, 1e-9) * f.rate_per_s * rate_scale * f.rate_bin_s)
    cycle_s = f.rate_bin_s * len(f.rate_profile)
    bins = len(f.rate_profile)
    ctx, outs = f.context_percentiles, f.output_percentiles
    drawn = 0
    work = 0.0  # the process runs in "expected arrivals" time, mapped back through the profile
    while True:
        work += rng.expovariate(1.0)
        cycles, w = divmod(work, edges[-1])
        i = min(bisect.bisect_right(edges, w) - 1, bins - 1)
        frac = (w - edges[i]) / (edges[i + 1] - edges[i])
        t = cycles * cycle_s + (i + frac) * f.rate_bin_s
        if duration_s is not None and t >= duration_s:
            return
        prompt = _sampler(ctx, rng)
        output = _sampler(outs, rng)
        pid = None
        if prefixes:
            pid = f"p{rng.randrange(prefixes)}"
            prompt = max(prompt, prefix_tokens)
        yield Request(round(t, 6), prompt, output, pid)
        drawn += 1
        if requests is not None and drawn >= requests:
            return


def _source(f: WorkloadFit, seed: int, rate_scale: float) -> str:
    return f"generate(seed={seed}, fit={f.name!r}" + (f", rate_scale={rate_scale:g}"
                                                      if rate_scale != 1.0 else "") + ")"


def generate(
    *,
    seed: int = 0,
    duration_s: float | None = None,
    requests: int | None = None,
    fit: WorkloadFit | None = None,
    rate_scale: float = 1.0,
    prefixes: int = 0,
    prefix_tokens: int = 0,
) -> Workload:
    """A synthetic workload drawn from ``fit`` (default: the Azure conversation trace's).

    Arrivals are a Poisson process whose rate follows the fit's rate profile (times
    ``rate_scale``), wrapping around after the fitted duration; prompt and output lengths are
    drawn independently from the fit's percentiles. The same arguments give the same
    requests (``random.Random(seed)``, no global state). At most :data:`MAX_REQUESTS` are
    held; :func:`generate_stream` draws longer spans as they are read.

    Args:
        seed: the seed.
        duration_s: generate arrivals in ``[0, duration_s)`` (default: the fit's duration
            when ``requests`` is None too).
        requests: stop after this many requests instead (>= 1).
        fit: the statistics (default :func:`azure_conv_fit`).
        rate_scale: multiplies the arrival rate, > 0 (2.0: twice the traffic).
        prefixes: shared prompt prefixes (0: none): each request gets ``prefix_id``
            ``"p<k>"``, k uniform in ``[0, prefixes)``.
        prefix_tokens: tokens of a shared prefix (for the record; the prompt length keeps
            them): prompts are at least this long when ``prefixes`` > 0.
    Returns:
        A :class:`Workload` in arrival order.
    Raises:
        ArgumentError: a bad argument.
        OutOfRangeError: a span expected to draw more than :data:`MAX_REQUESTS`.
    """
    f, span = _checked(fit, seed, duration_s, requests, rate_scale, prefixes, prefix_tokens,
                       MAX_REQUESTS)
    out = tuple(_draw(f, seed, span, requests, rate_scale, prefixes, prefix_tokens))
    return Workload(out, _source(f, seed, rate_scale))


def generate_stream(
    *,
    seed: int = 0,
    duration_s: float,
    fit: WorkloadFit | None = None,
    rate_scale: float = 1.0,
    prefixes: int = 0,
    prefix_tokens: int = 0,
) -> RequestStream:
    """:func:`generate`'s requests for ``duration_s``, drawn as they are read: a
    :class:`RequestStream` that holds none of them (a week is ``7 * 86400`` seconds).

    The same arguments give the same requests as ``generate(...)``, in the same order,
    each time the stream is read. Arguments as :func:`generate`'s; ``duration_s`` is
    needed (at most :data:`MAX_STREAM_S`).

    Raises:
        ArgumentError: a bad argument (``duration_s`` past :data:`MAX_STREAM_S` included).
    """
    number_arg("duration_s", duration_s, lo=0, hi=MAX_STREAM_S, lo_open=True,
               limit=f"a finite number of seconds in (0, {MAX_STREAM_S:g}]")
    f, _ = _checked(fit, seed, duration_s, None, rate_scale, prefixes, prefix_tokens, math.inf)
    opener = functools.partial(_draw, f, seed, float(duration_s), None, rate_scale, prefixes,
                               prefix_tokens)
    return RequestStream(opener, _source(f, seed, rate_scale), span_s=float(duration_s))
