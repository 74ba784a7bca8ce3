#!/bin/bash
# Issue 17's GPU benchmarks on the lent machine (the device tool, kind nvidia-h200), from the repository root:
#   bash bench/gpu_rl_step_device.sh STEP...      carry [".gpu"]
#   steps: decode | profile | profile-64 | profile-rl | profile-rl-loaded | served-gap | fused-norm | batching-0.5b | continuous | rl-0.5b | rl-0.5b-rollflow | rl-0.5b-compiled | rl-0.5b-megatron | rl-1.5b | rl-1.5b-megatron | report
# served-gap takes more bench/served_gap.py flags from $SERVED_GAP_ARGS (e.g. "--ways thread,server_idle").
# Needs the runtime bundle (.gpu/, ../shared/gpu/make-bundle.sh) and, for the TRL side, the wheels of TRL and the
# three packages it needs that the device image lacks, in .gpu/peer/ (they are unpacked into /tmp/peer):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .gpu/peer trl==1.16.0 datasets==5.2.0 'dill<0.4.2,>=0.3.0' 'multiprocess<0.70.20'
# Under $OUT: gpu_engine_decode.json (bench/gpu_engine_decode.py), gpu_flow_rl_step_*.json/.log and
# gpu_rl_step_trl_*.json/.log (bench/gpu_rl_step.py), gpu_rl_step.json and gpu_rl_step_table.md (report).
. .gpu/prelude.sh || exit 1
export BENCH_WORK=/tmp/rollflow_gpu_flow
if ls .gpu/peer/*.whl > /dev/null 2>&1; then
  python3 - <<'EOF'
import glob, zipfile
for w in glob.glob(".gpu/peer/*.whl"):
    zipfile.ZipFile(w).extractall("/tmp/peer")
EOF
  export PYTHONPATH=/tmp/peer:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1
for step in "$@"; do
  echo "== $step $(date +%T)"
  case $step in
    decode) timeout 300 python3 bench/gpu_engine_decode.py --compiled --unfolded --out "$OUT/gpu_engine_decode.json" \
              2>&1 | grep -v Warning | tail -12 ;;
    profile) timeout 300 python3 bench/gpu_engine_profile.py --out "$OUT/gpu_engine_profile.json" 2>&1 | tail -20 ;;
    profile-64) timeout 300 python3 bench/gpu_engine_profile.py --batch 64 --prompt-len 128 --new-tokens 128 \
                  --out "$OUT/gpu_engine_profile_64.json" 2>&1 | tail -20 ;;
    profile-rl) timeout 300 python3 bench/gpu_engine_profile.py --batch 512 --prompt-len 32 --new-tokens 1024 \
                  --repeats 3 --out "$OUT/gpu_engine_profile_rl.json" 2>&1 | tail -20 ;;
    profile-rl-loaded) timeout 300 python3 bench/gpu_engine_profile.py --batch 512 --prompt-len 32 --new-tokens 1024 \
                         --repeats 3 --model-path "$BENCH_WORK/qwen2_0.5b" \
                         --out "$OUT/gpu_engine_profile_rl_loaded.json" 2>&1 | tail -4 ;;
    served-gap) timeout 400 python3 bench/served_gap.py --py-spy .gpu/py-spy ${SERVED_GAP_ARGS:-} --out "$OUT/served_gap.json" 2>&1 \
                  | grep -v Warning | tail -60 ;;
    fused-norm) timeout 300 python3 bench/gpu_fused_norm.py --out "$OUT/gpu_fused_norm.json" 2>&1 | grep -v Warning | tail -8 ;;
    batching-0.5b) timeout 400 python3 bench/rollout_batching.py --device cuda --model 0.5b --max-new-tokens 1024 \
                     --modes announced --rollouts 3 --out "$OUT/rollout_batching_gpu.json" 2>&1 | tail -8 ;;
    continuous) timeout 300 python3 bench/gpu_continuous_batching.py --out "$OUT/gpu_continuous_batching.json" \
                  2>&1 | tail -6 ;;
    rl-0.5b) python3 bench/gpu_rl_step.py run --shape 0.5b --backend torch --out "$OUT" --timeout 360 ;;  # TRL: ~150 s first step
    rl-0.5b-rollflow) python3 bench/gpu_rl_step.py run --shape 0.5b --backend torch --sides rollflow --out "$OUT" \
                        --timeout 240 --tag-suffix ${RL_TAG_SUFFIX:-_fused} ;;
    rl-0.5b-compiled) python3 bench/gpu_rl_step.py run --shape 0.5b --backend torch --sides rollflow --out "$OUT" \
                        --timeout 300 --extra=--sglang-enable-torch-compile --tag-suffix _compiled ;;
    rl-0.5b-megatron) python3 bench/gpu_rl_step.py run --shape 0.5b --backend megatron --sides rollflow --out "$OUT" \
                        --timeout 240 ;;
    rl-1.5b) python3 bench/gpu_rl_step.py run --shape 1.5b --backend torch --sides rollflow --out "$OUT" \
               --timeout 320 --extra=--offload-train ;;
    rl-1.5b-megatron) python3 bench/gpu_rl_step.py run --shape 1.5b --backend megatron --out "$OUT" --timeout 360 ;;
    report) python3 bench/gpu_rl_step.py report --out "$OUT" --decode "$OUT/gpu_engine_decode.json" --write "$OUT" ;;
    *) echo "unknown step $step" ;;
  esac
done
