#!/usr/bin/env bash
# The GPU check in one call: the Triton kernels' op contracts and the MoE Triton tests compiled on CUDA, then
# benchmarks.gpu_triton (exactness of the dense `small` and the MoE `small_moe` presets, triton and native, fp32
# and bf16; speed at small and llama100m). For a lent GPU machine with no network: nothing is installed,
# the repository is put on PYTHONPATH. Everything goes under $OUT (default runs/gpu_check): env.txt, pytest.log,
# pytest.xml, gpu_triton.log, gpu_triton.json, summary.txt. Each part has a time limit, so the whole run ends
# within about 5 minutes whatever hangs (GPU_CHECK_PYTEST_S, default 110, and GPU_CHECK_BENCH_S, default 190, set the
# limits; GPU_CHECK_SPEED_PRESETS, default small,llama100m, the presets timed).
#
#     bash benchmarks/gpu_check.sh                                  # on the GPU machine
#     VEXACT_GPU_CHECK_REHEARSE=1 bash benchmarks/gpu_check.sh      # rehearsal without a GPU: Triton interpreter,
#                                                                   # a few tests and tiny sizes (not a measurement)
#
# Exit status: 0 every part passed; 1 a part failed or ran out of time; 2 no CUDA device (and not a rehearsal) or
# torch/triton missing.
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
# The package is imported as vexact_kernels (see kernels/__init__.py); a copy of the working tree lacks the link.
[ -e vexact_kernels ] || ln -s kernels vexact_kernels
REHEARSE="${VEXACT_GPU_CHECK_REHEARSE:-0}"
PYTEST_LIMIT="${GPU_CHECK_PYTEST_S:-110}"
BENCH_LIMIT="${GPU_CHECK_BENCH_S:-190}"
START=$(date +%s)

python - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import torch, triton
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}, "
      f"gpu: {torch.cuda.get_device_name(0) if cuda else 'none'}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "error: cannot import torch and triton (see $OUT/env.txt)"; exit 2; }
if [ "$REHEARSE" = 1 ]; then
    echo "rehearsal (VEXACT_GPU_CHECK_REHEARSE=1): Triton interpreter on CPU, a few tests, tiny sizes"
    TESTS=(-k "exp or rollout_logprobs_equal and triton-fp32")
    BENCH=(--device cpu --check-presets small_moe --dtype float32 --num-prompts 2 --max-prompt-len 3
           --max-new-tokens 2 --presets small_moe --reps 1 --batch 2 --prompt-len 3 --new-tokens 2)
elif python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    TESTS=()
    BENCH=(--check-presets small,small_moe --presets "${GPU_CHECK_SPEED_PRESETS:-small,llama100m}" --reps 3)
else
    echo "error: no CUDA device here (torch.cuda.is_available() is False); VEXACT_GPU_CHECK_REHEARSE=1 rehearses"
    exit 2
fi

echo "== op contracts and MoE tests (limit ${PYTEST_LIMIT}s)"
timeout "$PYTEST_LIMIT" python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_moe_triton.py --junitxml="$OUT/pytest.xml" "${TESTS[@]}" >"$OUT/pytest.log" 2>&1
PYTEST_RC=$?
tail -n 3 "$OUT/pytest.log"

echo "== benchmarks.gpu_triton (limit ${BENCH_LIMIT}s)"
timeout "$BENCH_LIMIT" python -m benchmarks.gpu_triton --out "$OUT/gpu_triton.json" "${BENCH[@]}" \
    >"$OUT/gpu_triton.log" 2>&1
BENCH_RC=$?
cat "$OUT/gpu_triton.log" | grep -v "^ *$" | tail -n 40

{
    echo "pytest: exit $PYTEST_RC ($(tail -n 1 "$OUT/pytest.log"))"
    echo "benchmarks.gpu_triton: exit $BENCH_RC$([ $BENCH_RC -eq 124 ] && echo ' (timed out: gpu_triton.json has the parts done)')"
    echo "elapsed: $(( $(date +%s) - START )) s"
} | tee "$OUT/summary.txt"
[ $PYTEST_RC -eq 0 ] && [ $BENCH_RC -eq 0 ]
