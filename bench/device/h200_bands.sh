#!/usr/bin/env bash
# Issue 27 on the device machine, one call (< 5 min): the shipped H200 profile refreshed on
# the card in about a minute (kvvmm calibrate --quick --profile h200), then the fidelity
# benchmark with bands, in the same session, for the refreshed profile (its growth, close and
# workload-decode ratios against the 0.9-1.1 target) and the shipped one scored against this
# run (a session other than its calibration's: share of medians in band against 90%).
# Needs torch, cuda-bindings, numpy, pytest only (no tqdm: the bars are optional). Carry the
# C fast path if built here (kvvmm/driver/_cudafast.abi3.so); else it is built (make ext).
#
#   bash bench/device/h200_bands.sh        # writes $OUT/r/*.json and *.log
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${OUT:?set OUT}/r
mkdir -p "$R"
[ -f kvvmm/driver/_cudafast.abi3.so ] || make ext PYTHON=python3 > "$R/ext.log" 2>&1
step() { local t=$1 name=$2; shift 2; echo "== $name (limit ${t}s)"; local t0=$SECONDS
  timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"; tail -n 6 "$R/$name.log"
  # SNAP_TGZ / SNAP_DIR (h200_session.sh short): a tarball of what finished, after each step
  [ -z "${SNAP_TGZ:-}" ] || tar czf "$SNAP_TGZ" -C "$SNAP_DIR" . ; }
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/nvidia-smi.txt" 2>&1
# 1. the one-minute refresh (its own clock: refreshed.seconds in the JSON)
step 75 refresh python3 -m kvvmm calibrate --quick --profile h200 --out "$R/h200-refreshed.json"
# 2. fidelity with bands for the refreshed profile, same session (3 rounds, parity kept)
step 160 fidelity-refreshed python3 -m kvvmm.measure.fidelity --profile "$R/h200-refreshed.json" \
  --out "$R/h200-fidelity-refreshed.json"
# 3. the shipped profile's bands against this run's measurements (sim side only: seconds;
#    NO_SCORE=1 leaves it to a CPU machine, with the same command on the fetched JSON)
[ -n "${NO_SCORE:-}" ] || step 45 score-shipped python3 -m kvvmm.measure.fidelity --profile h200 \
  --score "$R/h200-fidelity-refreshed.json" --out "$R/h200-fidelity-bands-shipped.json"
ls -la "$R"
