#!/usr/bin/env bash
# Every GPU check of the repository in one go, for a lent GPU machine whose python3 already holds torch and
# triton (the device image: torch 2.11, triton 3.6, transformers) but not tandem's other dependencies.
#
#   bash benchmarks/gpu_lease.sh            # logs under $OUT (default /tmp/gpu-lease)
#
# Stages, each under its own time limit so that one that hangs or fails leaves the others' figures:
#   env      nvidia-smi, versions
#   kernels  benchmarks/kernels_gpu.py   (copy bandwidth, decode and prefill attention alone)
#   tests    tests/workers/kernels (all of it: on a GPU the kernels run compiled, bf16 @gpu tests included), the
#            @gpu engine tests (greedy tokens vs HF, bf16 logits vs HF, decode through CUDA graphs) and the FP8
#            GEMM paths against their references (tests/workers/test_fp8.py)
#   engine   benchmarks/engine_gpu.py    (batch-1 roofline fraction, throughput vs HF generate)
#   quant    benchmarks/quant_gpu.py     (FP8 weights against BF16: batch-1 decode, 64 and 256 concurrent)
#   stepcost benchmarks/step_cost.py     (the calibrated step cost model against measured steps)
#   fp8gemm  benchmarks/fp8_gemm_gpu.py  (a decode step's FP8 GEMMs alone, against BF16's and the copy bandwidth)
#   breakdown benchmarks/engine_gpu_breakdown.py (host vs device time of a step, top kernels)  } not by
#   sweep    benchmarks/kernels_gpu_sweep.py (the attention kernel's launch configurations)     } default
# STAGES="breakdown sweep" bash benchmarks/gpu_lease.sh runs the named stages only, in that order.
#
# tandem is not installed there: its packages are linked into a folder on PYTHONPATH (the repository root
# cannot go on the path, since its operator/ folder would shadow the standard library's `operator`).
# Missing pure or binary dependencies travel as wheels in .whl/ (see docs/benchmarks.md, "Running them on a
# lent machine"), installed into /tmp/site.
set -u
OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
ROOT=$(pwd)

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
SRC=/tmp/tandem-src
rm -rf "$SRC" && mkdir -p "$SRC/tandem"
for entry in "$ROOT"/tandem/*; do ln -s "$entry" "$SRC/tandem/"; done
for sub in workers router operator; do ln -sfn "$ROOT/$sub" "$SRC/tandem/$sub"; done
export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH}

stage() {  # stage NAME SECONDS COMMAND...: runs it, its output to the console and to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    lscpu | grep -E "^(Model name|CPU\(s\)):"  # the host launches the kernels: short ones' timings depend on it
    "$PY" -c "import torch, triton, transformers, platform; print('python', platform.python_version(), \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', \
transformers.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
    "$PY" -c "import tandem.workers.engine.llm_engine as e; print('tandem imports from', e.__file__)"
} 2>&1 | tee "$OUT/env.txt"

# The tests' session fixture builds the native CPU kernels; build them now, beside the GPU work, not inside
# the tests' time limit.
"$PY" -c "from tandem.workers.kernels import cpu_extension as c; c.load(); print('cpu kernels:', c.build_error() or 'built')" \
    >"$OUT/cpu_build.txt" 2>&1 &
cpu_build=$!

parallel=()  # pytest-xdist is in the device image; TEST_WORKERS=0 runs the tests in one process
[ "${TEST_WORKERS:-8}" != 0 ] && parallel=(-n "${TEST_WORKERS:-8}")
for name in ${STAGES:-kernels tests engine quant stepcost fp8gemm}; do
    case $name in
    kernels) stage kernels "${KERNELS_LIMIT:-90}" "$PY" benchmarks/kernels_gpu.py ;;
    tests)
        # The build must be over: tests/workers/kernels/test_cpu_build_lock.py plants a stale lock that a build still
        # running beside it would remove (its first run on an H200 failed so).
        wait "$cpu_build"
        # TEST_PATHS="..." runs those instead (a rerun of the ones that failed).
        stage tests "${TESTS_LIMIT:-170}" "$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" -o addopts="" \
        --timeout 160 -rfE ${TEST_PATHS:-tests/workers/kernels tests/workers/test_cuda_graphs.py \
        "tests/workers/test_engine_triton.py::test_triton_engine_greedy_matches_hf_and_torch_backend[cuda]" \
        tests/workers/test_engine_triton.py::test_bf16_logits_stay_close_to_hf \
        tests/workers/test_fp8.py::test_the_gpu_paths_match_their_references \
        tests/workers/test_calibration.py::test_calibration_on_a_gpu_engine_with_its_graphs} ;;
    engine) stage engine "${ENGINE_LIMIT:-300}" "$PY" benchmarks/engine_gpu.py --skip-kernels ${ENGINE_ARGS:-} ;;
    quant) stage quant "${QUANT_LIMIT:-300}" "$PY" benchmarks/quant_gpu.py ;;
    stepcost) stage stepcost "${STEPCOST_LIMIT:-120}" "$PY" benchmarks/step_cost.py ;;
    fp8gemm) stage fp8gemm "${FP8GEMM_LIMIT:-150}" "$PY" benchmarks/fp8_gemm_gpu.py ;;
    breakdown) stage breakdown "${BREAKDOWN_LIMIT:-150}" "$PY" benchmarks/engine_gpu_breakdown.py ;;
    sweep) stage sweep "${SWEEP_LIMIT:-150}" "$PY" benchmarks/kernels_gpu_sweep.py ;;
    *) echo "unknown stage $name" ;;
    esac
done
wait
cat "$OUT/cpu_build.txt"
