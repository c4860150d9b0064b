#!/usr/bin/env bash
# The one driver of device runs: each mode fits one device call (< 10 min) and writes each
# step's log and result under $OUT, the results named by the card (h200-, h100-, gpu-).
#
#   bash bench/device/card_check.sh [MODE]
#
#   check (default)  every GPU test (the capture test alone first), the vLLM adapter's per-call
#                    overhead beside vLLM's CudaVmmDriver, kvvmm calibrate on the card while time
#                    is left, then the phases of an 8 GiB sleep. Carry .gpu/vllm-0.34.0 (a copy of
#                    ../shared/reference/vllm-0.34.0); with .seed carried the seed's tests run too
#   bench            kvvmm bench; SGLang's arena beside it where .seed/kv_vmm_backing_seed.py is
#                    carried (.whl: tqdm's wheel, where the machine has none)
#   peer             kvcached 0.1.6 built from its sdist (carry .peers: a copy of
#                    ../shared/peers/kvcached-0.1.6.tar.gz), then bench/elastic/bench_elastic.py:
#                    the elastic backing's per-request cost beside kvcached's, the bandwidth
#                    (the requests are the conversation trace's where .data holds it)
#   growth           the 64 x 122 decode growth by layout, after a sleep gap and a kernel gap
#   sleep            torch_memory_saver built from its sdist (carry .peers-tms: the sdist, and
#                    prebuilt/, the same built elsewhere against CUDA 13.0's headers, used where
#                    this machine cannot build), bench_sleep.py on GIB=60 GiB beside it
#                    (REPS=1), then the GPU sleep tests
#   budget           bench/budget/bench_budget.py and bench/elastic/bench_giveback.py on CUDA
#   distributed      bench/distributed/bench_distributed.py on nccl, one rank per GPU
#   peer-read        bench/peer/bench_peer.py: a KV buffer on GPU 1 read from GPU 0 (two GPUs)
#   sglang           SGLang 0.5.23's own pools on kvvmm and on its own owner (carry .sglang-min,
#                    .seed and .whl-sglang: msgspec's wheel)
#   beforeafter      kvvmm's CudaDriver per call at .gpu/before (a git archive of an earlier
#                    commit) and at this tree, alternating (bench/device/percall_beforeafter.py)
set -u
: "${OUT:?set OUT to the folder results go to}"
mode=${1:-check}
case $mode in check|bench|peer|growth|sleep|budget|distributed|peer-read|sglang|beforeafter) ;;
  *) echo "card_check.sh: no mode $mode (check, bench, peer, growth, sleep, budget," \
       "distributed, peer-read, sglang, beforeafter)" >&2; exit 2 ;; esac
[ "$mode" != beforeafter ] || [ -d .gpu/before ] || { echo "card_check.sh beforeafter: carry" \
  ".gpu/before (git archive COMMIT | tar -x -C .gpu/before)" >&2; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD KVVMM_REQUIRE_FASTPATH=1 KVVMM_VLLM_DIR=$PWD/.gpu/vllm-0.34.0
[ -f .seed/kv_vmm_backing_seed.py ] && export KVVMM_SEED_FILE=$PWD/.seed/kv_vmm_backing_seed.py
T0=$SECONDS
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1); echo "card: $card, mode: $mode"
case $card in *H200*) tag=h200 ;; *H100*) tag=h100 ;; *) tag=gpu ;; esac
mkdir -p "$OUT"; nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c 'import torch, cuda.bindings; print(torch.__version__, torch.cuda.is_available())'
make ext PYTHON=python3 > "$OUT/ext.log" 2>&1 || echo "ext build failed"
step() { local t=$1 name=$2; shift 2; echo "== $name (limit ${t}s) at $((SECONDS-T0))s"; local t0=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"; tail -n 6 "$OUT/$name.log"; }
wheels() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$@" && export PYTHONPATH=/tmp/site:$PWD; }
CAPTURE=tests/gpu/test_cuda_driver.py::test_unmap_during_cuda_graph_capture_is_refused_and_the_capture_survives
GPU_TESTS="tests/gpu tests/driver/test_driver_contract.py tests/driver/test_cudafast.py
  tests/driver/test_driver_robustness.py tests/driver/test_fault_matrix.py
  tests/driver/test_driver_threads.py tests/owner/test_elastic.py tests/owner/test_owner.py
  tests/owner/test_elastic_hardening.py tests/owner/test_captures.py tests/arena/test_reclaim.py"

build_tms() {  # torch_memory_saver into /tmp/tms-site: built from the sdist, else the prebuilt
  local site=/tmp/tms-site link=/tmp/tms-link home=${CUDA_HOME:-} rt cu
  rm -rf "$site" "$link" /tmp/tms-wheel; mkdir -p "$site" "$link"
  # CUDA's headers: a toolkit, else the pip wheels torch brought (nvidia/cu13/include, ...)
  [ -n "$home" ] || { [ -f /usr/local/cuda/include/cuda.h ] && home=/usr/local/cuda; }
  [ -n "$home" ] || home=$(python3 -c "import glob,os,site
for h in sorted(p for r in site.getsitepackages() for p in glob.glob(os.path.join(r,'nvidia','**','include','cuda.h'),recursive=True)):
    if os.path.exists(os.path.join(os.path.dirname(h),'cuda_runtime_api.h')): print(os.path.dirname(os.path.dirname(h))); break")
  # link against the libcudart torch loads and the system's libcuda (unversioned names)
  rt=$(python3 -c "import glob,site,os;print(next(iter(sorted(p for r in site.getsitepackages() for p in glob.glob(os.path.join(r,'nvidia','**','libcudart.so.13'),recursive=True))),''))")
  [ -n "$rt" ] || rt=$(ls "$home"/lib*/libcudart.so.13 2>/dev/null | head -1)
  [ -n "$rt" ] && ln -sf "$rt" "$link/libcudart.so"
  cu=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
  if [ -n "$cu" ]; then ln -sf "$cu" "$link/libcuda.so"
  else  # a stub to link against, as CUDA's lib64/stubs: the driver's libcuda.so.1 resolves at load
    echo 'void tms_libcuda_stub(void) {}' > "$link/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/stub.c"; fi
  echo "CUDA headers: ${home:-none}; libcudart: ${rt:-none}; libcuda: ${cu:-stub}"
  if [ -n "$home" ] && [ -n "$rt" ] && CUDA_HOME=$home TMS_CUDA_MAJOR=13 LIBRARY_PATH=$link \
      CPATH=$home/include python3 -m pip wheel -q --no-deps --no-build-isolation --no-index \
      -w /tmp/tms-wheel .peers-tms/torch_memory_saver-*.tar.gz; then
    python3 -m zipfile -e /tmp/tms-wheel/torch_memory_saver-*.whl "$site" && echo "built here" && return 0
  fi
  [ -d .peers-tms/prebuilt/torch_memory_saver ] && cp -r .peers-tms/prebuilt/. "$site"/ && \
    echo "could not build here: the prebuilt one" && return 0
  echo "torch_memory_saver: neither built nor prebuilt"; return 1
}

case $mode in
  check)
    step 40 gpu-capture python3 -m pytest -q -p no:cacheprovider -rs "$CAPTURE"
    step 270 gpu-tests python3 -m pytest -q -p no:cacheprovider -rs -x \
      --deselect "$CAPTURE" $GPU_TESTS
    step 70 vllm-overhead python3 bench/vllm_overhead/bench_vllm_overhead.py --driver cuda \
      --out "$OUT/$tag-vllm-overhead.json"
    # calibrate takes what is left but the last 130 s, kept for the sleep's phases
    left=$((570 - 130 - (SECONDS - T0)))
    [ $left -gt 60 ] && step $left calibrate python3 -m kvvmm calibrate --out "$OUT/$tag-calibrated.json"
    # where a sleep's time goes on this card (8 GiB, 3 reps a backup: ~60 s on an H100):
    # phases per rep, the chunked default against the serial path and a kept one
    left=$((570 - (SECONDS - T0))); [ $left -gt 130 ] && left=130
    [ $left -gt 45 ] && step $left sleep-phases python3 bench/sleep/bench_sleep.py --gib 8 --reps 3 \
      --out "$OUT/$tag-sleep-phases.json" ;;
  bench)
    [ -d .whl ] && { wheels .whl/*.whl || exit 1; }
    seed=(); [ -n "${KVVMM_SEED_FILE:-}" ] && seed=(--seed-file "$KVVMM_SEED_FILE" \
      --seed-script bench/seed/seed_side_by_side.py)
    step 540 kvvmm-bench python3 -m kvvmm bench "${seed[@]}" --out "$OUT" ;;
  peer)
    [ -d .peers-build/kvcached ] || step 150 kvcached-build python3 -m pip install -q --no-index \
      --no-build-isolation --no-deps --target .peers-build .peers/kvcached-*.tar.gz
    step 220 churn-growth python3 bench/elastic/bench_elastic.py --churn-growth \
      --out "$OUT/$tag-elastic-churn-growth.json"
    step 280 bench-elastic python3 bench/elastic/bench_elastic.py --out "$OUT/$tag-elastic.json" ;;
  growth)
    step 540 growth-steps python3 bench/growth/bench_growth_steps.py --rounds 3 --gap both \
      --out "$OUT/$tag-growth-steps.json" ;;
  sleep)
    export -f build_tms; step 80 tms-build bash -c build_tms
    # no LD_LIBRARY_PATH: the child imports torch first, whose libcudart.so.13 then serves
    # torch_memory_saver's (hook_mode="torch" loads it after torch, not by LD_PRELOAD)
    step 290 bench-sleep python3 bench/sleep/bench_sleep.py --gib "${GIB:-60}" --reps "${REPS:-1}" \
      --tms-path /tmp/tms-site --tms-timeout 95 --out "$OUT/$tag-sleep.json"
    step 100 gpu-sleep-tests python3 -m pytest -q -p no:cacheprovider -rs \
      tests/gpu/test_gpu_sleep.py tests/gpu/test_gpu_sleep_owners.py ;;
  budget)
    step 120 budget python3 bench/budget/bench_budget.py --driver cuda --out "$OUT/$tag-budget.json"
    step 300 giveback python3 bench/elastic/bench_giveback.py --driver cuda \
      --out "$OUT/$tag-elastic-giveback.json" ;;
  distributed)
    n=$(nvidia-smi -L | wc -l)
    step 300 distributed python3 bench/distributed/bench_distributed.py --driver cuda \
      --backend nccl --world "$n" --out "$OUT/$tag-x$n-distributed-bench.json" ;;
  peer-read)
    step 300 bench-peer python3 bench/peer/bench_peer.py --out "$OUT" ;;
  sglang)  # .sglang-min: the wheel's sglang/ without the kernels and model code
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site-sglang .whl-sglang/*.whl || exit 1
    step 300 sglang-conformance env PYTHONPATH="/tmp/site-sglang:$PWD" \
      KVVMM_SGLANG_DIR="$PWD/.sglang-min" KVVMM_SGLANG_CONFORMANCE=1 \
      KVVMM_CONFORMANCE_OUT="$OUT/$tag-sglang-0.5.23-conformance.json" \
      python3 -m pytest -q -p no:cacheprovider -rs tests/conformance ;;
  beforeafter)
    (cd .gpu/before && make ext PYTHON=python3 > "$OUT/ext-before.log" 2>&1) || echo "ext build failed"
    step 540 percall python3 bench/device/percall_beforeafter.py --before .gpu/before \
      --out "$OUT/$tag-percall-beforeafter.json" ;;
esac
echo "done at $((SECONDS-T0))s"; ls -la "$OUT"
