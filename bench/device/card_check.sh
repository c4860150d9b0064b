#!/usr/bin/env bash
# One device call on whatever card is lent (< 10 min): every GPU test, the vLLM adapter's
# per-call overhead beside vLLM's own CudaVmmDriver, kvvmm calibrate on the card, then a
# short sleep benchmark (the phases of a sleep with contents). Needs,
# carried: .gpu/vllm-0.34.0 (a copy of ../shared/reference/vllm-0.34.0).
#   bash bench/device/card_check.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD KVVMM_REQUIRE_FASTPATH=1 KVVMM_VLLM_DIR=$PWD/.gpu/vllm-0.34.0
T0=$SECONDS
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1); echo "card: $card"
case $card in *H200*) tag=h200 ;; *H100*) tag=h100 ;; *) tag=gpu ;; esac
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
python3 -c 'import torch, cuda.bindings; print(torch.__version__, torch.cuda.is_available())'
make ext PYTHON=python3 > $OUT/ext.log 2>&1 || echo "ext build failed"
step() { local t=$1 name=$2; shift 2; echo "== $name (limit ${t}s) at $((SECONDS-T0))s"; local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"; tail -n 6 "$OUT/$name.log"; }
CAPTURE=tests/gpu/test_cuda_driver.py::test_unmap_during_cuda_graph_capture_is_refused_and_the_capture_survives
GPU_TESTS="tests/gpu tests/driver/test_driver_contract.py tests/driver/test_cudafast.py
  tests/driver/test_driver_robustness.py tests/driver/test_fault_matrix.py
  tests/driver/test_driver_threads.py tests/owner/test_elastic.py tests/owner/test_owner.py
  tests/owner/test_elastic_hardening.py tests/owner/test_captures.py tests/arena/test_reclaim.py"
step 40 gpu-capture python3 -m pytest -q -p no:cacheprovider -rs "$CAPTURE"
step 270 gpu-tests python3 -m pytest -q -p no:cacheprovider -rs -x --deselect "$CAPTURE" $GPU_TESTS
step 70 vllm-overhead python3 bench/vllm_overhead/bench_vllm_overhead.py --driver cuda --out $OUT/$tag-vllm-overhead.json
# calibrate takes what is left but the last 130 s, kept for the sleep's phases (issue 50)
left=$((570 - 130 - (SECONDS - T0)))
[ $left -gt 60 ] && step $left calibrate python3 -m kvvmm calibrate --out $OUT/$tag-calibrated.json
# where a sleep's time goes on this card (8 GiB, 3 reps a backup: ~60 s on an H100 at the
# 2026-12 rates): phases per rep, the chunked default against the serial path and a kept one
left=$((570 - (SECONDS - T0))); [ $left -gt 130 ] && left=130
[ $left -gt 45 ] && step $left sleep-phases python3 bench/sleep/bench_sleep.py --gib 8 --reps 3 --out $OUT/$tag-sleep-phases.json
echo "done at $((SECONDS-T0))s"
