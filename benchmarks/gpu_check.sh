#!/usr/bin/env bash
# The GPU check in one call: the Triton kernels' op contracts, backward and MoE tests compiled on CUDA, then
# benchmarks.gpu_triton (exactness of the dense `small` and the MoE `small_moe` presets, triton and native, fp32
# and bf16; speed at small and llama100m), then the real-size parts, in order of what they prove: from
# benchmarks.gpu_real exactness (qwen3_1_7b bf16, 16 prompts inside a batch of 64 / in 3s / the first 4 alone,
# rescored at micro-batches 8 and 3), train_memory (64 x 1,536 tokens of qwen3_1_7b, fwd + bwd in micro-batches of
# 8: peak memory) and rl_run (`vexact run --device cuda`, 10 RL steps at qwen3_0_6b at 0 mismatch); then `check`,
# the command a user types (`python -m vexact check --device cuda --preset qwen3_1_7b --dtype bf16`, its report in
# check_qwen3_1_7b.json); then moe (qwen3_30b_a3b, 2 layers), speed (peak memory and tokens/s of prefill, decode at
# positions 0/512/1023 and training fwd+bwd), launches (kernel launches and GPU-busy against wall time per decode
# step), graphed (the decode step at batch 64 eager and CUDA-graphed, exact and native), profiles (the kernels
# that take the GPU time of a decode step and of a training pass, exact and native), tiles (the exact matmul's
# tile survey: time at decode and prefill rows, bits against the current tiles) and rollout (generate eager and
# with cuda_graphs=True: tokens/s, the same bits).
# For a lent GPU machine with no network: nothing is installed, the repository is put on PYTHONPATH. Everything
# goes under $OUT (default runs/gpu_check): env.txt, pytest.log, pytest.xml, gpu_triton.log, gpu_triton.json,
# gpu_real.json (written after each part), gpu_real_<part>.log, tables.md (the benchmarks page's tables of
# gpu_real.json, also printed), check.log, check_qwen3_1_7b.json, summary.txt. Each
# part has a time limit, so the run
# ends whatever hangs: GPU_CHECK_PYTEST_S (default 100) and GPU_CHECK_BENCH_S (default 190; 600 in a rehearsal,
# whose Triton interpreter's speed is the CPU's: 282 s on an AVX2-only AMD EPYC) for the small-shape
# parts, GPU_CHECK_<PART>_S for each real-size part (defaults below: about 9 minutes together);
# GPU_CHECK_SPEED_PRESETS (default small,llama100m) the presets timed. GPU_CHECK_PACK (a directory, unset by
# default): the records and a tarball of the logs gathered there on exit (below). GPU_CHECK_ONLY: all (default),
# small (the small-shape parts), real (the real-size parts) or lease (what fits a 15-minute lease after the machine's start: the
# op-contract, MoE and backward tests compiled on CUDA, then the real-size parts speed, graphed, launches, profiles,
# rollout, tiles and exactness: 560 s if every part ran to its limit, about 5 minutes as measured, so run it
# under a 600 s command); GPU_CHECK_REAL_PARTS (default all eleven in order; with lease those seven)
# which real-size parts run.
#
#     bash benchmarks/gpu_check.sh                                  # on the GPU machine
#     VEXACT_GPU_CHECK_REHEARSE=1 bash benchmarks/gpu_check.sh      # rehearsal without a GPU: Triton interpreter,
#                                                                   # a few tests and tiny sizes (not a measurement)
#
# Exit status: 0 every part passed; 1 a part failed or ran out of time; 2 no CUDA device (and not a rehearsal) or
# torch/triton missing.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
# The kernel library is imported as vexact_kernels (see kernels/__init__.py), which an uninstalled copy of the tree
# does not have: the name is a link in a scratch directory of the script's own, put on PYTHONPATH. Never a link in
# the tree: another process importing from the tree (CI's tests run side by side) would import through it and lose
# its files when it goes.
import_dir=$(mktemp -d -t vexact-gpu-check.XXXXXXXX) || exit 2
PACK="${GPU_CHECK_PACK:-}"
# GPU_CHECK_PACK=DIR: on exit (a part's failure, the end, or a TERM from an outer time limit) the main records are
# copied into DIR and every other file under $OUT is packed into DIR/gpu_check_logs.tar.gz (no checkpoints, no
# warm-start cache): at most eight files, for a machine that hands back only a few.
pack() {
    [ -n "$PACK" ] || return 0
    mkdir -p "$PACK" || return 0
    for f in summary.txt gpu_real.json tables.md pytest.log env.txt check_qwen3_1_7b.json gpu_triton.json; do
        [ -f "$OUT/$f" ] && cp "$OUT/$f" "$PACK/"
    done
    tar czf "$PACK/gpu_check_logs.tar.gz" -C "$OUT" --exclude=warmstart_cache --exclude=checkpoints . 2>/dev/null
}
trap 'pack; rm -rf "$import_dir"' EXIT
ln -s "$PWD/kernels" "$import_dir/vexact_kernels"
export PYTHONPATH="$PWD:$import_dir${PYTHONPATH:+:$PYTHONPATH}"
REHEARSE="${VEXACT_GPU_CHECK_REHEARSE:-0}"
PYTEST_LIMIT="${GPU_CHECK_PYTEST_S:-100}"
[ "$REHEARSE" = 1 ] && BENCH_DEFAULT_S=600 || BENCH_DEFAULT_S=190
BENCH_LIMIT="${GPU_CHECK_BENCH_S:-$BENCH_DEFAULT_S}"
ONLY="${GPU_CHECK_ONLY:-all}"
ALL_REAL_PARTS="exactness train_memory rl_run check moe speed launches graphed profiles tiles rollout"
LEASE_REAL_PARTS="speed graphed launches profiles rollout tiles exactness"
[ "$ONLY" = lease ] && DEFAULT_PARTS="$LEASE_REAL_PARTS" || DEFAULT_PARTS="$ALL_REAL_PARTS"
REAL_PARTS="${GPU_CHECK_REAL_PARTS:-$DEFAULT_PARTS}"
declare -A REAL_LIMIT=([exactness]="${GPU_CHECK_EXACTNESS_S:-130}" [train_memory]="${GPU_CHECK_TRAIN_MEMORY_S:-60}"
                       [rl_run]="${GPU_CHECK_RL_RUN_S:-120}" [check]="${GPU_CHECK_CHECK_S:-90}"
                       [moe]="${GPU_CHECK_MOE_S:-75}" [speed]="${GPU_CHECK_SPEED_S:-60}"
                       [launches]="${GPU_CHECK_LAUNCHES_S:-30}" [graphed]="${GPU_CHECK_GRAPHED_S:-45}"
                       [profiles]="${GPU_CHECK_PROFILES_S:-45}" [tiles]="${GPU_CHECK_TILES_S:-75}"
                       [rollout]="${GPU_CHECK_ROLLOUT_S:-75}")
case "$ONLY" in all|small|real|lease) ;;
    *) echo "error: GPU_CHECK_ONLY must be all, small, real or lease, got '$ONLY'"; exit 2;; esac
# which groups the mode runs: the kernels' tests (all but real), the small-shape benchmark (all, small)
[ "$ONLY" != real ] && RUN_TESTS=1 || RUN_TESTS=0
[ "$ONLY" = all ] || [ "$ONLY" = small ] && RUN_SMALL_BENCH=1 || RUN_SMALL_BENCH=0
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
    REAL=(--device cpu --rehearse)
    # the check command at the preset's structure, narrowed (the sizes gpu_real's rehearsal uses)
    CHECK=(--device cpu --preset qwen3_1_7b --vocab-size 512 --hidden-size 64 --num-layers 1 --num-heads 4
           --num-kv-heads 2 --intermediate-size 64 --num-prompts 3 --max-prompt-len 4 --max-new-tokens 3)
elif python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    TESTS=()
    BENCH=(--check-presets small,small_moe --presets "${GPU_CHECK_SPEED_PRESETS:-small,llama100m}" --reps 3)
    REAL=(--device cuda)
    CHECK=(--device cuda --preset qwen3_1_7b --dtype bf16)
else
    echo "error: no CUDA device here (torch.cuda.is_available() is False); VEXACT_GPU_CHECK_REHEARSE=1 rehearses"
    exit 2
fi

PYTEST_RC=0
BENCH_RC=0
if [ "$RUN_TESTS" = 1 ]; then
    echo "== op contracts and MoE tests (limit ${PYTEST_LIMIT}s)"
    timeout "$PYTEST_LIMIT" python -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py \
        tests/kernels/test_moe_triton.py tests/kernels/test_triton_backward.py --junitxml="$OUT/pytest.xml" \
        "${TESTS[@]}" >"$OUT/pytest.log" 2>&1
    PYTEST_RC=$?
    tail -n 3 "$OUT/pytest.log"
fi
if [ "$RUN_SMALL_BENCH" = 1 ]; then
    echo "== benchmarks.gpu_triton (limit ${BENCH_LIMIT}s)"
    timeout "$BENCH_LIMIT" python -m benchmarks.gpu_triton --out "$OUT/gpu_triton.json" "${BENCH[@]}" \
        >"$OUT/gpu_triton.log" 2>&1
    BENCH_RC=$?
    cat "$OUT/gpu_triton.log" | grep -v "^ *$" | tail -n 40
fi

# The real-size parts: one process each (a hung or out-of-memory part cannot take the others with it); the part
# writes its result into gpu_real.json, and a part cut off by its limit is recorded there as timed out.
REAL_RC=0
REAL_LINES=()
if [ "$ONLY" != small ]; then
    rm -f "$OUT/gpu_real.json"
    for PART in $REAL_PARTS; do
        LIMIT="${REAL_LIMIT[$PART]:-}"
        [ -n "$LIMIT" ] || { echo "error: unknown real-size part '$PART' (GPU_CHECK_REAL_PARTS)"; exit 2; }
        if [ "$PART" = check ]; then  # the user's command, as typed (its own JSON report)
            echo "== python -m vexact check ${CHECK[*]} (limit ${LIMIT}s)"
            timeout "$LIMIT" python -m vexact check "${CHECK[@]}" --json "$OUT/check_qwen3_1_7b.json" \
                >"$OUT/check.log" 2>&1
            RC=$?
            tail -n 4 "$OUT/check.log"
            [ $RC -eq 0 ] || [ $RC -eq 124 ] || tail -n 25 "$OUT/check.log"
            REAL_LINES+=("vexact check: exit $RC$([ $RC -eq 124 ] && echo " (timed out after ${LIMIT}s)")")
            [ $RC -eq 0 ] || REAL_RC=1
            continue
        fi
        echo "== benchmarks.gpu_real --part $PART (limit ${LIMIT}s)"
        timeout "$LIMIT" python -m benchmarks.gpu_real --part "$PART" --out "$OUT/gpu_real.json" "${REAL[@]}" \
            >"$OUT/gpu_real_$PART.log" 2>&1
        RC=$?
        if [ $RC -eq 124 ]; then
            python -m benchmarks.gpu_real --timed-out "$PART" --limit-s "$LIMIT" --out "$OUT/gpu_real.json"
        fi
        tail -n 1 "$OUT/gpu_real_$PART.log"
        [ $RC -eq 0 ] || [ $RC -eq 124 ] || tail -n 25 "$OUT/gpu_real_$PART.log"  # the error, in the console
        REAL_LINES+=("gpu_real $PART: exit $RC$([ $RC -eq 124 ] && echo " (timed out after ${LIMIT}s)")")
        [ $RC -eq 0 ] || REAL_RC=1
    done
fi

if [ "$ONLY" != small ] && [ -f "$OUT/gpu_real.json" ]; then  # the page's tables, in the console and in tables.md
    echo "== python -m benchmarks.gpu_real --tables"
    python -m benchmarks.gpu_real --tables --out "$OUT/gpu_real.json" | tee "$OUT/tables.md"
fi

{
    [ "$RUN_TESTS" = 1 ] && echo "pytest: exit $PYTEST_RC ($(tail -n 1 "$OUT/pytest.log"))"
    if [ "$RUN_SMALL_BENCH" = 1 ]; then
        echo "benchmarks.gpu_triton: exit $BENCH_RC$([ $BENCH_RC -eq 124 ] && echo ' (timed out: gpu_triton.json has the parts done)')"
    fi
    for LINE in "${REAL_LINES[@]}"; do echo "$LINE"; done
    echo "elapsed: $(( $(date +%s) - START )) s"
} | tee "$OUT/summary.txt"
[ $PYTEST_RC -eq 0 ] && [ $BENCH_RC -eq 0 ] && [ $REAL_RC -eq 0 ]
