#!/usr/bin/env bash
# Issue 29 on an H200, in one call (< 5 minutes): what the budget broker adds to a commit on
# CUDA, then two engine processes sharing the card through it (bench/budget/h200_budget.py: both
# traces' first 10 minutes at 10x, ledger sums sampled against the budget, a limit lowered
# live with `kvvmm budget set`, one tenant SIGKILLed and its share's reclaim timed).
# Needs, carried: .data (AzureLLMInferenceTrace_conv.csv). Writes to $OUT:
#   h200-budget.json          the per-commit overhead (bench/budget/bench_budget.py --driver cuda)
#   h200-budget-tenants.json  the two-tenant run
#   budget-*.log              each step's output
#
#   bash bench/device/h200_budget.sh            # BUDGET_MIB=6144 MINUTES=10 SPEED=10 by default
set -u
: "${OUT:?set OUT to the folder results go to}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
BUDGET_MIB=${BUDGET_MIB:-6144} MINUTES=${MINUTES:-10} SPEED=${SPEED:-10}
mkdir -p "$OUT"
[ -f kvvmm/driver/_cudafast.abi3.so ] || make ext PYTHON=python3 > "$OUT/budget-ext.log" 2>&1
step() { local t=$1 name=$2; shift 2; echo "== $name (limit ${t}s)"; local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/budget-$name.log" 2>&1; local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s"; tail -n 25 "$OUT/budget-$name.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/budget-gpu.txt" 2>&1
step 90 overhead python3 bench/budget/bench_budget.py --driver cuda --out "$OUT/h200-budget.json"
step 200 tenants python3 bench/budget/h200_budget.py --driver cuda \
  --trace .data/AzureLLMInferenceTrace_conv.csv --minutes "$MINUTES" --speed "$SPEED" \
  --budget-mib "$BUDGET_MIB" --out "$OUT/h200-budget-tenants.json"
