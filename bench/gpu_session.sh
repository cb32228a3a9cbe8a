#!/usr/bin/env bash
# Every GPU measurement of this project, in commands that fit a one-GPU lease (at most
# 10 minutes a command, 30 minutes of device time a session):
#
#   bash bench/gpu_session.sh 1 OUT          # install, whole test suite, GPT-345M MFU and
#                                            # b=1 vs compiled GPT-2, the fused loss's
#                                            # gain, planner on the GPU, torch.profiler
#                                            # tables: ~12 min on an H100, more than one
#                                            # command; split it with GPU_SESSION_STEPS:
#   GPU_SESSION_STEPS=tests bash bench/gpu_session.sh 1 OUT                 # ~5 min
#   GPU_SESSION_STEPS="throughput cross_entropy_fusion planner_validation gpu_profile" \
#       bash bench/gpu_session.sh 1 OUT                                     # ~7 min
#   GPU_SESSION_STEPS="grad_accumulation compile_diagnosis" \
#       bash bench/gpu_session.sh 1 OUT                                     # ~5 min
#                                            # (install always runs)
#   bash bench/gpu_session.sh 2 OUT DATA     # GPT 12 x 768 convergence, Flush vs 2BW and
#                                            # the mitigations, on DATA (bench/convergence_gpu.py
#                                            # --prepare-data DATA, made beforehand on a CPU)
#   GPU_SESSION_DRY=1 bash bench/gpu_session.sh 1 OUT   # the same code on a CPU, tiny
#                                            # models, no test suite: checks the script
#
# OUT receives the benches' JSON and one session.log (the device tool returns at most 8
# files); each step has its own time limit and a failing step does not stop the next.
set -uo pipefail
part=${1:?usage: bash bench/gpu_session.sh 1|2 OUT [DATA]}
out=${2:?usage: bash bench/gpu_session.sh 1|2 OUT [DATA]}
data=${3:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
log="$out/session.log"
dry=${GPU_SESSION_DRY:-}
only=${GPU_SESSION_STEPS:-}
export PYTHONPATH=.

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    if [ -n "$only" ] && [ "$name" != install ] && [[ " $only " != *" $name "* ]]; then
        return 0
    fi
    start=$(date +%s)
    echo "== $name (limit ${limit} s): $*" | tee -a "$log"
    timeout "$limit" "$@" >> "$log" 2>&1
    rc=$?
    tail -n 3 "$log" | sed 's/^/   /'
    echo "== $name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
}

{ date -u; python3 -c "import torch; print('torch', torch.__version__, 'cuda', \
torch.cuda.is_available() and torch.cuda.get_device_name(0))"; } >> "$log" 2>&1
case "$part" in
1)
    if [ -z "$dry" ]; then
        step install 120 python3 -m pip install --no-deps --no-build-isolation -q -e .
        # -n: pytest-xdist is on the GPU machine; the suite is mostly CPU-bound gloo ranks
        step tests 330 python3 -m pytest -q -p no:cacheprovider -n 8
        step throughput 330 python3 -u bench/throughput.py --cuda-only --out-dir "$out"
        step cross_entropy_fusion 240 python3 -u bench/cross_entropy_fusion.py --out-dir "$out"
        step planner_validation 90 python3 -u bench/planner_validation.py --cuda --out-dir "$out"
        step gpu_profile 120 python3 -u bench/gpu_profile.py --out-dir "$out"
        step grad_accumulation 200 python3 -u bench/grad_accumulation.py --cuda --rounds 2 \
            --out-dir "$out"
        # why --compile-layers made the fused-loss step slower (session 12): dynamo's
        # recompiles and graph breaks into session.log, the compiled step's kernel table
        step compile_diagnosis 240 env TORCH_LOGS=recompiles,graph_breaks python3 -u \
            bench/gpu_profile.py --micro-batch-size 8 \
            --extra "--cross-entropy-loss-fusion --compile-layers" --out-dir "$out/compiled"
    else
        step throughput 300 python3 bench/throughput.py --cuda-only --gpu-dry-run \
            --out-dir "$out"
        step cross_entropy_fusion 300 python3 bench/cross_entropy_fusion.py --dry-run \
            --rounds 1 --out-dir "$out"
        step planner_validation 300 python3 bench/planner_validation.py --cuda --dry-run \
            --out-dir "$out"
        step gpu_profile 300 python3 bench/gpu_profile.py --dry-run --wait 1 --active 1 \
            --out-dir "$out"
        step grad_accumulation 300 python3 bench/grad_accumulation.py --quick --out-dir "$out"
    fi
    ;;
2)
    if [ -z "$data" ]; then
        echo "bench/gpu_session.sh 2: give the folder bench/convergence_gpu.py --prepare-data wrote" >&2
        exit 2
    fi
    [ -n "$dry" ] || step install 120 python3 -m pip install --no-deps --no-build-isolation -q -e .
    step convergence_gpu 560 python3 bench/convergence_gpu.py --data-dir "$data" \
        --iters 1000 --budget-seconds 520 --out-dir "$out" \
        --figure "$out/convergence_gpu_gpt.png" ${dry:+--smoke}
    ;;
*)
    echo "bench/gpu_session.sh: part must be 1 or 2, got '$part'" >&2
    exit 2
    ;;
esac
ls -l "$out" | tee -a "$log"
