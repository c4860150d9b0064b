#!/usr/bin/env bash
# Every GPU test and benchmark of a session, on the device machine, in two calls that each
# fit its 10-minute limit. The device returns at most 8 files from $OUT, so each part leaves
# one tarball (results-<part>.tgz) plus its log. Needs, carried: .whl (tqdm), .seed (SGLang's
# kv_vmm_backing.py as kv_vmm_backing_seed.py), .data (Azure's conversation trace CSV).
#
#   bash bench/device/h200_session.sh tests   # tests/gpu + the CUDA contract rows, then kvvmm bench
#   bash bench/device/h200_session.sh rest    # calibrate, workload replay, distributed
#   bash bench/device/h200_session.sh elastic # every GPU test, per-request cost beside kvcached
#                                      # (.peers: its sdist), the 64 x 122 growth by layout
#   bash bench/device/h200_session.sh sglang  # SGLang 0.5.23's pools on kvvmm and on its own owner
#                                      # (.sglang-min, .seed, .whl-sglang: msgspec's wheel),
#                                      # then every GPU test
#   bash bench/device/h200_session.sh beforeafter  # kvvmm bench at .before, then here
#   bash bench/device/h200_session.sh steps   # every GPU test, then the 64 x 122 growth by layout
#                                      # with a sleep gap and a kernel gap (< 9 min)
#   bash bench/device/h200_session.sh short   # what one call of a short device budget holds (< 10 min):
#                                      # the steps with the kernel gap, the replay of prefix and
#                                      # request-ranges+deferred (.data, what admit-when-ready
#                                      # changed)
#   ROUNDS=3 STRATEGIES="prefix request-ranges+deferred" TAG=-a bash bench/device/h200_session.sh ranges
#                                      # the range strategies on the trace, CUDA beside the sim
set -u
part=${1:?tests or rest}
export PYTHONUNBUFFERED=1 KVVMM_REQUIRE_FASTPATH=1
R=$OUT/r
# short: results outside $OUT, a tarball into it after each step (a run cut at its limit
# still brings back what finished; $OUT returns at most 8 files)
case $part in short) R=/tmp/kvvmm-$part ;; esac
mkdir -p "$R"
export PYTHONPATH=$PWD
case $part in elastic|ranges|sglang|beforeafter|steps|short) ;; *)  # tqdm, for the seed file's comparison
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1 ;;
esac
[ -f kvvmm/driver/_cudafast.abi3.so ] || make ext PYTHON=python3 > "$R/ext.log" 2>&1
# Every GPU test: tests/gpu, and the files of the CPU suite whose driver kinds take in the CUDA
# driver where a GPU is usable (their sim and host rows run too).
GPU_TESTS="tests/gpu tests/driver/test_driver_contract.py tests/driver/test_cudafast.py
  tests/driver/test_driver_robustness.py tests/driver/test_fault_matrix.py
  tests/driver/test_driver_threads.py tests/owner/test_elastic.py tests/owner/test_owner.py"
CAPTURE=tests/gpu/test_cuda_driver.py::test_unmap_during_cuda_graph_capture_is_refused_and_the_capture_survives
step() { local t=$1 name=$2; shift 2; echo "== $name (limit ${t}s)"; local t0=$SECONDS
  timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"; tail -n 4 "$R/$name.log"
  case $part in short) tar czf "$OUT/results-$part.tgz" -C "$R" . ;; esac; }
# Every GPU test in two processes, with these limits: the capture-refusal test alone (in a
# full run on a fresh machine it failed twice and left the allocator so that empty_cache
# aborted the process 69 tests later; undiagnosed, alone it passes: isolated, its result still
# counts and the rest runs), then the rest.
gpu_tests() { step "$1" gpu-capture-test env OUT="$R" python3 -m pytest -q -p no:cacheprovider \
    -rs "$CAPTURE"
  step "$2" gpu-tests env OUT="$R" python3 -m pytest -q -p no:cacheprovider -rs \
    --deselect "$CAPTURE" $GPU_TESTS; }
# kvcached 0.1.6 from its sdist (.peers), once per machine
kvcached_build() { [ -d .peers-build/kvcached ] || step "$1" kvcached-build python3 -m pip \
  install -q --no-index --no-build-isolation --no-deps --target .peers-build \
  .peers/kvcached-*.tar.gz; }
case $part in
  tests)
    nvidia-smi > "$R/nvidia-smi.txt" 2>&1
    step 230 gpu-tests env OUT="$R" python3 -m pytest -q -p no:cacheprovider -rs \
      $GPU_TESTS
    step 330 kvvmm-bench python3 -m kvvmm bench --seed-file .seed/kv_vmm_backing_seed.py \
      --seed-script bench/seed/seed_side_by_side.py --out "$R" ;;
  rest)
    step 150 calibrate python3 -m kvvmm calibrate --out "$R/h200-calibrated.json"
    step 170 workload python3 bench/workload/bench_workload_gpu.py \
      --trace .data/AzureLLMInferenceTrace_conv.csv --seconds 600 --out "$R/h200-workload.json"
    step 60 distributed python3 bench/distributed/bench_distributed.py --driver cuda --backend nccl \
      --world 1 --out "$R/h200-distributed-bench.json" ;;
  elastic)
    nvidia-smi > "$R/nvidia-smi.txt" 2>&1
    kvcached_build 120
    gpu_tests 60 180
    step 200 bench-elastic python3 bench/elastic/bench_elastic.py --out "$R/h200-elastic.json"
    step 170 growth-steps python3 bench/growth/bench_growth_steps.py --rounds 3 \
      --out "$R/h200-growth-steps.json" ;;
  steps)  # the decode thread's growth steps after a change to them, and every GPU test
    nvidia-smi > "$R/nvidia-smi.txt" 2>&1
    gpu_tests 60 200
    step 260 growth-steps python3 bench/growth/bench_growth_steps.py --rounds 3 --gap both \
      --out "$R/h200-growth-steps.json" ;;
  short)  # the growth steps and the range replay
    nvidia-smi > "$R/nvidia-smi.txt" 2>&1
    # the growth first: of the two, the one only an H200 run settles (the replay's figures
    # held on two H100 loans); a call cut short still brings it back
    step 140 growth-steps python3 bench/growth/bench_growth_steps.py --rounds 3 --gap kernel \
      --out "$R/h200-growth-steps-kernel.json"
    step 100 workload-ranges python3 bench/workload/bench_workload_gpu.py \
      --trace .data/AzureLLMInferenceTrace_conv.csv --seconds 600 --strategy prefix \
      --strategy request-ranges+deferred --rounds 3 --out "$R/h200-workload-ranges.json" ;;
  sglang)  # SGLang 0.5.23's own pools on kvvmm beside its own owner (.sglang-min: the wheel's
           # sglang/ without the kernels and model code, which the suite stands in for)
    nvidia-smi > "$R/nvidia-smi.txt" 2>&1
    # msgspec (SGLang's pool layouts are its Structs), from .whl-sglang: the machine has none
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site-sglang .whl-sglang/*.whl || exit 1
    step 200 sglang-conformance env PYTHONPATH="/tmp/site-sglang:$PWD" \
      KVVMM_SGLANG_DIR="$PWD/.sglang-min" \
      KVVMM_SGLANG_CONFORMANCE=1 KVVMM_CONFORMANCE_OUT="$R/h200-sglang-0.5.23-conformance.json" \
      python3 -m pytest -q -p no:cacheprovider -rs tests/conformance
    [ -n "${NO_GPU_TESTS:-}" ] || step 60 gpu-capture-test env OUT="$R" python3 -m pytest -q \
      -p no:cacheprovider -rs "$CAPTURE"
    [ -n "${NO_GPU_TESTS:-}" ] || step 200 gpu-tests env OUT="$R" KVVMM_SEED_FILE="$PWD/.seed/kv_vmm_backing_seed.py" \
      python3 -m pytest -q -p no:cacheprovider -rs --deselect "$CAPTURE" $GPU_TESTS ;;
  beforeafter)  # kvvmm bench (no seed) at .before (a git archive of an earlier commit), then
                # at this tree, on one machine minutes apart: did a change move the figures?
    nvidia-smi > "$R/nvidia-smi.txt" 2>&1
    (cd .before && make ext PYTHON=python3 > "$R/ext-before.log" 2>&1)
    mkdir -p "$R/before" "$R/after"
    step 290 bench-before env PYTHONPATH="$PWD/.before" sh -c \
      "cd .before && python3 -m kvvmm bench --out '$R/before'"
    step 290 bench-after python3 -m kvvmm bench --out "$R/after" ;;
  ranges)  # STRATEGIES (space-separated) and ROUNDS pick what runs; the JSON grows per strategy
    strategies=${STRATEGIES:-prefix xl-page-elastic request-ranges request-ranges+deferred}
    args=(); for s in $strategies; do args+=(--strategy "$s"); done
    step 560 workload-ranges python3 bench/workload/bench_workload_gpu.py \
      --trace .data/AzureLLMInferenceTrace_conv.csv --seconds 600 "${args[@]}" \
      --rounds "${ROUNDS:-1}" --out "$R/h200-workload-ranges${TAG:-}.json" ;;
esac
tar czf "$OUT/results-$part.tgz" -C "$R" . && rm -rf "$R"
ls -la "$OUT"
