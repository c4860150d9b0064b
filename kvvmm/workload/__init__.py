"""Workloads: request traces, a fitted generator, a serving model and memory strategies.

Replay a trace (or a generated workload) through a continuous-batching serving model and a
memory strategy that drives a real :class:`~kvvmm.owner.KvBufferOwner` on any driver, and
compare strategies: memory held against used over time, driver calls and the decode-path
stall they cost, preemptions. See :func:`~kvvmm.workload.run.run_workload`; several models
sharing one simulated GPU's budget: :mod:`kvvmm.workload.tenants`.
"""

from __future__ import annotations

from kvvmm.workload.generator import (
    WorkloadFit,
    azure_conv_fit,
    fit_workload,
    generate,
    generate_stream,
)
from kvvmm.workload.requests import (
    AZURE_CONV_TRACE,
    Request,
    RequestStream,
    Workload,
    find_trace,
    load_azure_csv,
    load_jsonl,
    load_workload,
    save_jsonl,
)
from kvvmm.workload.run import (
    RunOptions,
    RunSetup,
    StrategyResult,
    Timeline,
    WorkloadComparison,
    run_workload,
)
from kvvmm.workload.serving import (
    SLOT_ORDERS,
    ServingConfig,
    ServingModel,
    ServingStats,
    SlotAllocator,
    StepTimeModel,
)
from kvvmm.workload.strategies import (
    STRATEGIES,
    PageElastic,
    PostCaptureFinalize,
    PrefixGrowth,
    Static,
    Strategy,
    make_strategy,
)
from kvvmm.workload.tally import Tally
from kvvmm.workload.tenants import (
    Demand,
    Tenant,
    TenantResult,
    TenantsRun,
    compare_tenants,
    run_tenants,
)

__all__ = [
    "AZURE_CONV_TRACE",
    "SLOT_ORDERS",
    "STRATEGIES",
    "Demand",
    "PageElastic",
    "PostCaptureFinalize",
    "PrefixGrowth",
    "Request",
    "RequestStream",
    "RunOptions",
    "RunSetup",
    "ServingConfig",
    "ServingModel",
    "ServingStats",
    "SlotAllocator",
    "Static",
    "StepTimeModel",
    "Strategy",
    "StrategyResult",
    "Tally",
    "Tenant",
    "TenantResult",
    "TenantsRun",
    "Timeline",
    "Workload",
    "WorkloadComparison",
    "WorkloadFit",
    "azure_conv_fit",
    "compare_tenants",
    "find_trace",
    "fit_workload",
    "generate",
    "generate_stream",
    "load_azure_csv",
    "load_jsonl",
    "load_workload",
    "make_strategy",
    "run_tenants",
    "run_workload",
    "save_jsonl",
]
