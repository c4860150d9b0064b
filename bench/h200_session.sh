#!/usr/bin/env bash
# Every GPU test and benchmark of a session, on the device machine, in two calls that each
# fit its 10-minute limit. The device returns at most 8 files from $OUT, so each part leaves
# one tarball (results-<part>.tgz) plus its log. Needs, carried: .whl (tqdm), .seed (SGLang's
# kv_vmm_backing.py as kv_vmm_backing_seed.py), .data (Azure's conversation trace CSV).
#
#   bash bench/h200_session.sh tests   # tests/gpu + the CUDA contract rows, then kvvmm bench
#   bash bench/h200_session.sh rest    # calibrate, fidelity, workload replay, distributed
#   bash bench/h200_session.sh elastic # every GPU test, per-request cost beside kvcached
#                                      # (.peers: its sdist), the 64 x 122 growth by layout
#   ROUNDS=3 STRATEGIES="prefix request-ranges+deferred" TAG=-a bash bench/h200_session.sh ranges
#                                      # the range strategies on the trace, CUDA beside the sim
set -u
part=${1:?tests or rest}
export PYTHONUNBUFFERED=1 KVVMM_REQUIRE_FASTPATH=1
R=$OUT/r
mkdir -p "$R"
export PYTHONPATH=$PWD
if [ "$part" != elastic ] && [ "$part" != ranges ]; then  # tqdm, for the seed file's comparison
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
[ -f kvvmm/driver/_cudafast.abi3.so ] || make ext PYTHON=python3 > "$R/ext.log" 2>&1
step() { local t=$1 name=$2; shift 2; echo "== $name (limit ${t}s)"; local t0=$SECONDS
  timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t0)) s"; tail -n 4 "$R/$name.log"; }
case $part in
  tests)
    nvidia-smi > "$R/nvidia-smi.txt" 2>&1
    step 230 gpu-tests env OUT="$R" python3 -m pytest -q -p no:cacheprovider -rs \
      tests/gpu tests/test_driver_contract.py tests/test_cudafast.py
    step 330 kvvmm-bench python3 -m kvvmm bench --seed-file .seed/kv_vmm_backing_seed.py \
      --seed-script bench/seed_side_by_side.py --out "$R" ;;
  rest)
    step 150 calibrate python3 -m kvvmm calibrate --out "$R/h200-calibrated.json"
    step 170 fidelity python3 bench/bench_fidelity.py --profile "$R/h200-calibrated.json" \
      --out "$R/h200-fidelity.json"
    step 170 workload python3 bench/bench_workload_gpu.py \
      --trace .data/AzureLLMInferenceTrace_conv.csv --seconds 600 --out "$R/h200-workload.json"
    step 60 distributed python3 bench/bench_distributed.py --driver cuda --backend nccl \
      --world 1 --out "$R/h200-distributed-bench.json" ;;
  elastic)
    nvidia-smi > "$R/nvidia-smi.txt" 2>&1
    [ -d .peers-build/kvcached ] || step 120 kvcached-build python3 -m pip install -q \
      --no-index --no-build-isolation --no-deps --target .peers-build .peers/kvcached-*.tar.gz
    step 180 gpu-tests env OUT="$R" python3 -m pytest -q -p no:cacheprovider -rs \
      tests/gpu tests/test_driver_contract.py tests/test_cudafast.py
    step 200 bench-elastic python3 bench/bench_elastic.py --out "$R/h200-elastic.json"
    step 170 growth-steps python3 bench/bench_growth_steps.py --rounds 3 \
      --out "$R/h200-growth-steps.json" ;;
  ranges)  # STRATEGIES (space-separated) and ROUNDS pick what runs; the JSON grows per strategy
    strategies=${STRATEGIES:-prefix xl-page-elastic request-ranges request-ranges+deferred}
    args=(); for s in $strategies; do args+=(--strategy "$s"); done
    step 560 workload-ranges python3 bench/bench_workload_gpu.py \
      --trace .data/AzureLLMInferenceTrace_conv.csv --seconds 600 "${args[@]}" \
      --rounds "${ROUNDS:-1}" --out "$R/h200-workload-ranges${TAG:-}.json" ;;
esac
tar czf "$OUT/results-$part.tgz" -C "$R" . && rm -rf "$R"
ls -la "$OUT"
