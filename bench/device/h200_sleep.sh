#!/usr/bin/env bash
# Issue 28 on the H200, in one device call of at most 8 minutes (80 + 290 + 100 s limits):
# torch_memory_saver built from its sdist, bench/sleep/bench_sleep.py (a 60 GiB llama-3.1-70b TP8
# rank-0 pool, kvvmm beside torch_memory_saver), then tests/gpu/test_gpu_sleep.py and
# tests/gpu/test_gpu_sleep_owners.py. Everything lands under $OUT/sleep.
#
#   bash bench/device/h200_sleep.sh            # all three (carry .peers-tms)
#   bash bench/device/h200_sleep.sh bench      # the build and the benchmark only
#   bash bench/device/h200_sleep.sh tests      # the GPU tests only
#   bash bench/device/h200_sleep.sh build      # only build torch_memory_saver (runs anywhere)
#
# Carried: .peers-tms (gitignored): torch_memory_saver-0.0.10.tar.gz (pip download of the
# sdist), and prebuilt/, the same sdist built on the workstation against CUDA 13.0's headers
# (cp-abi3 .so files, libcudart.so.13 only): used when the device cannot build (no CUDA
# headers there). The build needs g++, cuda.h and cuda_runtime_api.h, libcudart.so to link
# (no nvcc: its sources are plain C++), and TMS_CUDA_MAJOR=13.
set -u
part=${1:-all}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT/sleep
mkdir -p "$R"
REPS=${REPS:-1}  # 60 GiB: each host-backed sleep pins 60 GiB (~0.4 s/GiB seen with torch's)
GIB=${GIB:-60}
step() { local t=$1 name=$2; shift 2; echo "== $name (limit ${t}s)"; local t0=$SECONDS
  timeout "$t" "$@" > "$R/$name.log" 2>&1; local rc=$?; echo "   rc=$rc in $((SECONDS - t0)) s"
  tail -n 6 "$R/$name.log"; return $rc; }
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
[ -f kvvmm/driver/_cudafast.abi3.so ] || make ext PYTHON=python3 > "$R/ext.log" 2>&1

build_tms() {  # -> /tmp/tms-site holding torch_memory_saver, from the sdist or the prebuilt
  local site=/tmp/tms-site link=/tmp/tms-link
  rm -rf "$site" "$link" /tmp/tms-wheel; mkdir -p "$site" "$link"
  # CUDA's headers: a toolkit, else the pip wheels torch brought (nvidia/cu13/include, ...).
  local home=${CUDA_HOME:-}
  [ -n "$home" ] || { [ -f /usr/local/cuda/include/cuda.h ] && home=/usr/local/cuda; }
  if [ -z "$home" ]; then
    home=$(python3 - <<'EOF'
import glob, os, site
for root in site.getsitepackages():
    for h in glob.glob(os.path.join(root, "nvidia", "**", "include", "cuda.h"), recursive=True):
        inc = os.path.dirname(h)
        if os.path.exists(os.path.join(inc, "cuda_runtime_api.h")):
            print(os.path.dirname(inc)); raise SystemExit
EOF
)
  fi
  echo "CUDA headers: ${home:-none found}"
  # Link against the libcudart torch loads and the system's libcuda (unversioned names).
  local rt; rt=$(python3 -c "import glob,site,os;print(next(iter(sorted(p for r in site.getsitepackages() for p in glob.glob(os.path.join(r,'nvidia','**','libcudart.so.13'),recursive=True))),''))")
  [ -n "$rt" ] || rt=$(ls "$home"/lib*/libcudart.so.13 2>/dev/null | head -1)
  [ -n "$rt" ] && ln -sf "$rt" "$link/libcudart.so"
  local cu; cu=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
  if [ -n "$cu" ]; then ln -sf "$cu" "$link/libcuda.so"
  else  # no driver library to link (-lcuda): a stub, as CUDA's own lib64/stubs; the
        # driver's libcuda.so.1 resolves the symbols at load time
    echo 'void tms_libcuda_stub(void) {}' > "$link/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/stub.c"; cu=stub
  fi
  echo "libcudart: ${rt:-none}; libcuda: ${cu:-none}"
  if [ -n "$home" ] && [ -n "$rt" ] && \
     CUDA_HOME=$home TMS_CUDA_MAJOR=13 LIBRARY_PATH=$link CPATH=$home/include \
     python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w /tmp/tms-wheel \
       .peers-tms/torch_memory_saver-*.tar.gz; then
    python3 -m zipfile -e /tmp/tms-wheel/torch_memory_saver-*.whl "$site" && \
      echo "torch_memory_saver: built on this machine" && return 0
  fi
  if [ -d .peers-tms/prebuilt/torch_memory_saver ]; then
    cp -r .peers-tms/prebuilt/. "$site"/ && \
      echo "torch_memory_saver: could not build here; the workstation's build (CUDA 13.0 headers)"
    return 0
  fi
  echo "torch_memory_saver: neither built nor prebuilt"; return 1
}

export -f build_tms
case $part in all|bench|build) step 80 tms-build bash -c build_tms ;; esac
case $part in all|bench)
  # No LD_LIBRARY_PATH: the child imports torch first, whose libcudart.so.13 then satisfies
  # torch_memory_saver's (hook_mode="torch" loads it after torch, not by LD_PRELOAD).
  step 290 bench-sleep python3 \
    bench/sleep/bench_sleep.py --gib "$GIB" --reps "$REPS" --tms-path /tmp/tms-site \
    --tms-timeout 95 --out "$R/h200-sleep.json" ;;
esac
case $part in all|tests)
  step 100 gpu-sleep-tests env OUT="$R" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/gpu/test_gpu_sleep.py tests/gpu/test_gpu_sleep_owners.py ;;
esac
ls -la "$R"
