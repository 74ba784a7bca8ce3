#!/bin/bash
# The GPU flow on the lent machine (the device tool, kind nvidia-h200), from the repository root, carry [".gpu"]:
#   bash bench/gpu_flow_device.sh STEP...
#   steps: tests | demo-torch | demo-megatron | shape-0.5b | shape-1.5b | shape-1.5b-megatron | debug | external
#          | parallel
#          | regress (also the demo on a `rollflow serve`) | megatron-flags | side-by-side | chunk | chunk-bench
#          | new-flags | async-save-0.5b | profiling | loss-memory | forward-batching | s30-demos
#          | recompute-refusal | s32-regress | s33-regress | s35-windowed | s35-families | s35-families-2 | s35-flash-window
#          | s36-moe | s36-moe-2 | s36-moe-3 | s36-moe-flows | s37-moe | s37-replay | s37-replay-min | s38-replay | s38-replay-min | s40 | s40-r3 | s40-r3-min
#          | s41-reshardable | s41-sp | s42 | s43 | s43-shape | s43-engine-only | s43-det-only | s46-tests
# Under $OUT: nvidia_smi.txt, pytest_gpu.txt, gpu_flow_<tag>.json and .log (bench/gpu_flow.py). The bundle of the
# runtime dependencies (.gpu/, ../shared/gpu/make-bundle.sh) is unpacked by the prelude. The device tool brings back
# at most 8 files: with more, everything under $OUT is packed into $OUT/results.tgz at the end.
. .gpu/prelude.sh || exit 1
export BENCH_WORK=/tmp/rollflow_gpu_flow
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1
for step in "$@"; do
  echo "== $step $(date +%T)"
  case $step in
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_flow.py --timeout 400 \
             > "$OUT/pytest_gpu.txt" 2>&1; tail -25 "$OUT/pytest_gpu.txt" ;;
    demo-torch) python3 bench/gpu_flow.py demo --backend torch --out "$OUT" --timeout 300 ;;
    demo-megatron) python3 bench/gpu_flow.py demo --backend megatron --bf16 --out "$OUT" --timeout 360 ;;
    shape-0.5b) python3 bench/gpu_flow.py shape --shape 0.5b --backend torch --bf16 --out "$OUT" --timeout 300 ;;
    shape-1.5b) python3 bench/gpu_flow.py shape --shape 1.5b --backend torch --bf16 --out "$OUT" --timeout 420 ;;
    shape-1.5b-megatron) python3 bench/gpu_flow.py shape --shape 1.5b --backend megatron --bf16 --out "$OUT" \
                           --timeout 420 ;;
    debug) python3 bench/gpu_flow.py debug --backend torch --out "$OUT" --timeout 240 ;;
    external) python3 bench/gpu_flow.py external --backend torch --out "$OUT" --timeout 240 ;;
    regress)  # everything on the tiny model at once, one GPU: the GPU and Megatron tests, both demos, debug flags
      (timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flow.py --timeout 500 \
         > "$OUT/pytest_gpu.txt" 2>&1) &
      (timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_megatron_backend.py \
         tests/test_megatron_graphs.py tests/test_megatron_cpu_model.py --timeout 500 \
         > "$OUT/pytest_megatron.txt" 2>&1) &
      python3 bench/gpu_flow.py demo --backend torch --out "$OUT" --timeout 480 &
      python3 bench/gpu_flow.py debug --backend torch --out "$OUT" --timeout 240 > "$OUT/gpu_debug.txt" 2>&1 &
      python3 bench/gpu_flow.py external --backend torch --out "$OUT" --timeout 240 > "$OUT/gpu_external.txt" 2>&1 &
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --out "$OUT" --timeout 500
      wait; tail -n 4 "$OUT/pytest_gpu.txt" "$OUT/pytest_megatron.txt"; tail -30 "$OUT/gpu_debug.txt"
      tail -4 "$OUT/gpu_external.txt" ;;
    megatron-flags)  # slime's training flags on the megatron backend: the GPU test against the torch backend, then
                     # SFT then OPD through the flow
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_megatron_backend.py -k torch_backends \
        --timeout 380 > "$OUT/pytest_megatron_flags.txt" 2>&1; tail -25 "$OUT/pytest_megatron_flags.txt"
      python3 bench/gpu_flow.py distill --backend megatron --bf16 --out "$OUT" --timeout 240 ;;
    side-by-side)  # three runs start their engines at the same moment on one GPU (each its own Ray cluster: the
                   # port race of two registries both starting at 30000), then the 0.5B shape runs on alone
      python3 bench/gpu_flow.py demo --backend torch --out "$OUT" --timeout 400 &
      python3 bench/gpu_flow.py tool --backend megatron --bf16 --out "$OUT" --timeout 400 &
      python3 bench/gpu_flow.py shape --shape 0.5b --backend torch --bf16 --out "$OUT" --timeout 520
      wait ;;
    parallel)  # the GPU tests ∥ the 0.5B shape ∥ the Megatron demo: one call, three processes on one GPU
      (timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_flow.py --timeout 400 \
         > "$OUT/pytest_gpu.txt" 2>&1) &
      python3 bench/gpu_flow.py shape --shape 0.5b --backend torch --bf16 --out "$OUT" --timeout 540 &
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --out "$OUT" --timeout 400
      wait; tail -5 "$OUT/pytest_gpu.txt" ;;
    chunk|chunk-bench)  # --log-probs-chunk-size: its GPU tests (both backends; not with chunk-bench), then
                        # bench/log_probs_chunk.py's memory and time at 16k tokens, and Megatron's at 64k
      if [ "$step" = chunk ]; then
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_megatron_backend.py tests/test_gpu_flow.py \
          -k "chunk" --timeout 280 > "$OUT/pytest_chunk.txt" 2>&1; tail -8 "$OUT/pytest_chunk.txt"
      fi
      specs=("16384 torch,megatron -1,4096,1024" "65536 megatron -1,1024")
      [ -n "$CHUNK_SPECS" ] && IFS=';' read -ra specs <<< "$CHUNK_SPECS"  # e.g. "16384 megatron -1,1024;..."
      for spec in "${specs[@]}"; do
        set -- $spec
        python3 bench/log_probs_chunk.py all --out "$OUT/chunk_$1" --tokens "$1" --backends "$2" --chunks="$3" \
          > "$OUT/log_probs_chunk_$1.txt" 2>&1
        tail -12 "$OUT/log_probs_chunk_$1.txt"
        for ext in json md; do cp "$OUT/chunk_$1/log_probs_chunk.$ext" "$OUT/log_probs_chunk_$1.$ext"; done
        rm -rf "$OUT/chunk_$1"
      done ;;
    new-flags)  # 2026-12-05's flags on the GPU: --check-weight-update-equal and --async-save in both colocated demos
                # (CUDA IPC sync; Megatron bf16), min_new_tokens on the GPU engine, and the GPU tests beside them
      (timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flow.py tests/test_megatron_backend.py \
         --timeout 500 > "$OUT/pytest_gpu.txt" 2>&1) &
      python3 bench/gpu_min_new_tokens.py --out "$OUT" > "$OUT/gpu_min_new_tokens.txt" 2>&1 &
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 12 --out "$OUT" --timeout 480 \
        --extra "--check-weight-update-equal --async-save" &
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 12 --out "$OUT" --timeout 500 \
        --extra "--check-weight-update-equal --async-save"
      wait; tail -n 4 "$OUT/pytest_gpu.txt"; tail -c 1500 "$OUT/gpu_min_new_tokens.txt"
      grep -h "check-weight-update-equal\|RF14\|commit-" "$OUT"/gpu_flow_demo_*.log | tail -12 ;;
    profiling)  # --use-pytorch-profiler / --record-memory-history on the GPU: the CUDA test, then both colocated
                # demos (torch fp32: train_overall + the allocator's history; megatron bf16: train_actor and
                # train_log_probs) with the profiled rollouts' files listed and the traces' kernel counts
      (timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_profiling.py --timeout 280 \
         > "$OUT/pytest_profiling.txt" 2>&1) &
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 6 --out "$OUT" --timeout 400 \
        --extra "--use-pytorch-profiler --profile-step-start 3 --profile-step-end 5 --record-memory-history
                 --memory-snapshot-num-steps 4" &
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 450 \
        --extra "--use-pytorch-profiler --profile-step-start 3 --profile-step-end 5 --profile-target train_actor
                 train_log_probs --log-kl"
      wait; tail -n 4 "$OUT/pytest_profiling.txt"
      python3 - "$BENCH_WORK" <<'PY' | tee "$OUT/profiling_files.txt"
import gzip, json, pathlib, pickle, sys
for d in sorted(pathlib.Path(sys.argv[1]).glob("demo_*/w/profile")):
    for f in sorted(d.iterdir()):
        if f.name.endswith(".json.gz"):
            ev = json.loads(gzip.decompress(f.read_bytes()))["traceEvents"]
            kinds = {c: sum(e.get("cat") == c for e in ev) for c in ("kernel", "cpu_op", "gpu_memcpy")}
            print(d.parent.parent.name, f.name, f.stat().st_size, kinds)
        else:
            snap = pickle.loads(f.read_bytes())
            print(d.parent.parent.name, f.name, f.stat().st_size, "segments", len(snap["segments"]),
                  "trace entries", sum(map(len, snap["device_traces"])))
PY
      grep -h "wrote \|Completed\|Failed" "$OUT"/gpu_flow_demo_*.log | tail -16 ;;
    async-save-0.5b)  # --async-save on the Qwen2.5-0.5B shape (torch, bf16), a checkpoint after every rollout,
                      # without then with the flag, one after the other (each from a fresh --save)
      for mode in ${ASYNC_SAVE_ORDER:-plain async}; do  # ASYNC_SAVE_ORDER="async plain": the other order
        rm -rf "$BENCH_WORK/ck_05b_torch_bf16"
        extra="--save-interval 1"; [ $mode = async ] && extra="$extra --async-save"
        python3 bench/gpu_flow.py shape --shape 0.5b --backend torch --bf16 --num-rollout 4 --out "$OUT" \
          --timeout 280 --part "_$mode" --extra "$extra"
      done
      python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("gpu_flow_05b_*.json")):
    d = json.loads(f.read_text())
    print(f.name, d.get("state"), "loop", d.get("loop_wall_s"), json.dumps(d.get("save_per_rollout")))
PY
      ;;
    loss-memory)  # --recompute-loss-function: a train step's peak memory and time against the whole head, both
                  # backends, 16k tokens in one micro-batch (bench/log_probs_chunk.py's `recompute` variant)
      python3 bench/log_probs_chunk.py all --out "$OUT/loss" --tokens 16384 --backends torch,megatron \
        --chunks=-1,recompute > "$OUT/loss_memory.txt" 2>&1; tail -8 "$OUT/loss_memory.txt"
      for ext in json md; do cp "$OUT/loss/log_probs_chunk.$ext" "$OUT/loss_memory.$ext"; done; rm -rf "$OUT/loss" ;;
    forward-batching)  # --log-probs-max-tokens-per-gpu: the old log-probs' forward over 32k tokens, both backends
      python3 bench/log_probs_batching.py all --out "$OUT/fb" --backends torch,megatron --caps 0,8192,32768 \
        > "$OUT/forward_batching.txt" 2>&1; tail -9 "$OUT/forward_batching.txt"
      for ext in json md; do cp "$OUT/fb/log_probs_batching.$ext" "$OUT/forward_batching.$ext"; done
      rm -rf "$OUT/fb" ;;
    s30-demos)  # --log-probs-max-tokens-per-gpu through both colocated demos (torch: --use-stateless-adam too),
                # the GPU tests beside them, and
                # --recompute-loss-function's refusal on CUDA (a third run, after them, that must stop at the trainer's start)
      (timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flow.py tests/test_megatron_backend.py \
         --timeout 500 > "$OUT/pytest_gpu.txt" 2>&1) &
      flags="--use-dynamic-batch-size --max-tokens-per-gpu 256 --log-probs-max-tokens-per-gpu 4096 --log-kl"
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 12 --out "$OUT" --timeout 480 \
        --extra "$flags --use-stateless-adam" &
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 12 --out "$OUT" --timeout 500 \
        --extra "$flags"
      wait; tail -n 4 "$OUT/pytest_gpu.txt"
      # the torch backend's fixed cost per no-grad forward on the GPU (~25 ms at 2,048 tokens): a profile of one
      python3 bench/log_probs_batching.py one --backend torch --out "$OUT" --json "$OUT/fwd_torch_0.json" \
        --profile "$OUT/torch_forward_profile.txt" > /dev/null 2>&1; head -60 "$OUT/torch_forward_profile.txt"
      rm -rf /tmp/rollflow_gpu_flow/ck_torch  # after the torch demo (same work dir and --save): a fresh start
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 2 --out "$OUT/refusal" --timeout 200 \
        --extra=--recompute-loss-function > "$OUT/gpu_recompute_refusal.txt" 2>&1
      grep -rh "would change nothing" "$OUT/refusal" | head -c 600; echo
      grep -h "Completed\|Failed\|RF[0-9]" "$OUT"/gpu_flow_demo_*.log | tail -12 ;;
    s32-regress)  # after sessions 31–32's start-up changes (the API server launched before Prefect's import, Ray
                  # before it, the local cluster started with address "local"): the GPU tests beside both colocated
                  # demos (12 rollouts each), as in s30-demos without its flags
      (timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flow.py tests/test_megatron_backend.py \
         --timeout 500 > "$OUT/pytest_gpu.txt" 2>&1) &
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 12 --out "$OUT" --timeout 480 &
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 12 --out "$OUT" --timeout 500
      wait; tail -n 4 "$OUT/pytest_gpu.txt" ;;
    s33-regress)  # after session 33's batched task-run recorder (plumbing/api_server.py): s32-regress, then every
                  # task run of the last 8 flow runs (the demos', the tests') read from Prefect's database
      (timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flow.py tests/test_megatron_backend.py \
         tests/test_prestart.py --timeout 500 > "$OUT/pytest_gpu.txt" 2>&1) &
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 12 --out "$OUT" --timeout 480 &
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 12 --out "$OUT" --timeout 500
      wait; tail -n 4 "$OUT/pytest_gpu.txt"
      python3 - <<'PY' 2>&1 | tee "$OUT/prefect_task_runs.txt"
import collections, json, os, sqlite3
from pathlib import Path
home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
db = sqlite3.connect(home / "prefect.db")
for run_id, name, state in db.execute("select id, name, state_type from flow_run order by created desc limit 8"):
    tasks = db.execute("select name, state_type from task_run where flow_run_id = ?", (run_id,)).fetchall()
    print(json.dumps({"flow_run": name, "state": state, "task_runs": len(tasks),
                      "by_state": collections.Counter(s for _, s in tasks),
                      "rollout_tasks": sum(n.startswith("rollout-") for n, _ in tasks)}))
PY
      ;;
    recompute-refusal)  # --recompute-loss-function on CUDA: the torch backend built on the GPU must refuse it
      python3 - <<'PY' 2>&1 | tail -4 | tee "$OUT/recompute_refusal.txt"
from engine.config import RunConfig
from engine.config.data import BUNDLED_MODEL
from engine.train.torch_backend import TorchBackend
try:
    TorchBackend(RunConfig(hf_checkpoint=BUNDLED_MODEL, recompute_loss_function=True), device="cuda")
    print("NOT REFUSED")
except ValueError as e:
    print("refused:", e)
PY
      ;;
    s35-windowed)  # session 35: sliding-window layers and Gemma 2's logit softcapping in the engine's CUDA graphs
                   # and the packed trainer. The CPU-side tests in the device's torch and transformers, then the GPU
                   # tests (the new ones among them) beside both colocated demos (the graph decoder's attention
                   # changed for every model)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py tests/test_forward.py \
        tests/test_continuous_batching.py --timeout 280 > "$OUT/pytest_cpu_side.txt" 2>&1; tail -n 3 "$OUT/pytest_cpu_side.txt"
      (timeout 540 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_flow.py tests/test_megatron_backend.py \
         --timeout 500 > "$OUT/pytest_gpu.txt" 2>&1) &
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 12 --out "$OUT" --timeout 480 &
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 12 --out "$OUT" --timeout 500
      wait; grep -E "sliding|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 8 ;;
    s35-families)  # after the fixes s35-windowed found (Gemma's RMSNorm, the tests' eager reference): the CPU-side
                   # tests in the device's torch and transformers, then every GPU test (the seven model families of
                   # tests/model_families.py among them)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py tests/test_forward.py \
        tests/test_fused_norm.py tests/test_continuous_batching.py --timeout 280 > "$OUT/pytest_cpu_side.txt" 2>&1
      tail -n 3 "$OUT/pytest_cpu_side.txt"
      timeout 500 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_flow.py tests/test_megatron_backend.py \
        --timeout 480 > "$OUT/pytest_gpu.txt" 2>&1; grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 8 ;;
    s35-families-2)  # after the capture error that names --sglang-disable-cuda-graph: the families' GPU tests
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_flow.py -k "families or engine_on_cuda" \
        --timeout 280 > "$OUT/pytest_gpu.txt" 2>&1; grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 8 ;;
    s35-flash-window)  # the flash kernel's own sliding window in training (bf16): its unit test against the masked
                       # fp32 reference, the model families, the other flash and Megatron GPU tests
      timeout 400 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_flow.py tests/test_megatron_backend.py \
        -k "flash or families or gpu_megatron or engine_on_cuda" --timeout 380 > "$OUT/pytest_gpu.txt" 2>&1
      grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 8 ;;
    s36-moe)  # session 36: Qwen3-MoE and Mistral on the Megatron backend, MoE weights under the checkpoint's names
              # (both backends, CUDA IPC into the engine's fused experts), then colocated flows on random models
      timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py \
        tests/test_megatron_cpu_model.py tests/test_weight_sync.py tests/test_megatron_mapping.py \
        -k "moe or mixture or 1-" --timeout 320 > "$OUT/pytest_gpu.txt" 2>&1
      grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 8
      bash "$0" s36-moe-flows ;;  # (the first call ran them here, two sharing one --save: fixed after it)
    s36-moe-2)  # after the first call: where the Megatron MoE grad norm differs (bench/debug/moe_grads.py), the
                # fp32 MoE engine without graphs, the CPU model test on a GPU host, then the flows of s36-moe
      python3 bench/debug/moe_grads.py "$OUT" alltoall allgather > "$OUT/moe_grads.txt" 2>&1
      grep -v Warning "$OUT/moe_grads.txt" | tail -n 4 | cut -c1-1500
      timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_cpu_model.py tests/test_gpu_flow.py \
        -k "megatron_model_matches or families_on_cuda" --timeout 230 > "$OUT/pytest_gpu.txt" 2>&1
      grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 8
      bash "$0" s36-moe-flows ;;
    s36-moe-3)  # the Megatron MoE GPU test on a model without a pad token (the one difference s36-moe-2 found: the pad
                # row of the embedding, which transformers' padding_idx never trains), the CPU model test on a GPU host
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py \
        tests/test_megatron_cpu_model.py -k "moe or megatron_model_matches" --timeout 190 > "$OUT/pytest_gpu.txt" 2>&1
      grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 8 ;;
    s36-moe-flows)  # (the flows of s36-moe alone)
      for f in qwen3moe mistral; do
        python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from model_families import \
save_model; save_model(Path('$BENCH_WORK/$f'), '$f', 'examples/tiny-qwen2-arith')" > /dev/null 2>&1
      done
      extra="--rollout-max-truncated-share 1 --rollout-max-response-len 24 --hf-checkpoint $BENCH_WORK"
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron /tmp/rollflow_gpu_flow/ck_torch
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 240 \
        --extra "$extra/qwen3moe" &
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 6 --out "$OUT" --timeout 240 \
        --extra "$extra/qwen3moe"
      wait
      for f in "$OUT"/gpu_flow_demo_*; do mv "$f" "${f/gpu_flow_demo_/gpu_flow_qwen3moe_}"; done
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron  # the demo's --save: a new model is a new run (RF05)
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 200 \
        --extra "$extra/mistral"
      for f in "$OUT"/gpu_flow_demo_*; do mv "$f" "${f/gpu_flow_demo_/gpu_flow_mistral_}"; done ;;
    s37-moe)  # Mixtral and Qwen2-MoE on the Megatron backend: the GPU test against the torch backend (all three MoE
              # families), the CPU model test on a GPU host, the engine's families test, then one flow each
      (timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py \
         tests/test_megatron_cpu_model.py tests/test_gpu_flow.py \
         -k "moe or megatron_model_matches or (families_on_cuda and (mixtral or qwen2moe))" --timeout 400 \
         > "$OUT/pytest_gpu.txt" 2>&1) &
      for f in mixtral qwen2moe; do
        python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from model_families import \
save_model; save_model(Path('$BENCH_WORK/$f'), '$f', 'examples/tiny-qwen2-arith')" > /dev/null 2>&1
      done
      extra="--rollout-max-truncated-share 1 --rollout-max-response-len 24 --hf-checkpoint $BENCH_WORK"
      for f in mixtral qwen2moe; do  # one after the other: the demo's --save and work dir are per backend
        rm -rf /tmp/rollflow_gpu_flow/ck_megatron
        python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 200 \
          --extra "$extra/$f"
        for g in "$OUT"/gpu_flow_demo_*; do mv "$g" "${g/gpu_flow_demo_/gpu_flow_${f}_}"; done
      done
      wait; grep -E "^FAILED|^SKIPPED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 12 ;;
    s37-replay)  # --use-routing-replay: Megatron's RouterReplay against the torch backend's hooks (three MoE families),
                 # the CPU tests, then Qwen3-MoE flows with two steps per rollout (the second replays), both backends
      (timeout 400 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py \
         tests/test_routing_replay.py -k "routing_replay or replay or recorded" --timeout 380 \
         > "$OUT/pytest_gpu.txt" 2>&1) &
      python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from model_families import \
save_model; save_model(Path('$BENCH_WORK/qwen3moe'), 'qwen3moe', 'examples/tiny-qwen2-arith')" > /dev/null 2>&1
      extra="--rollout-max-truncated-share 1 --rollout-max-response-len 24 --hf-checkpoint $BENCH_WORK/qwen3moe \
--use-routing-replay --num-steps-per-rollout 2 --global-batch-size 32"
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron /tmp/rollflow_gpu_flow/ck_torch
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 220 \
        --extra "$extra" &
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 6 --out "$OUT" --timeout 220 --extra "$extra"
      wait; for g in "$OUT"/gpu_flow_demo_*; do mv "$g" "${g/gpu_flow_demo_/gpu_flow_replay_}"; done
      grep -E "^FAILED|^SKIPPED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 12 ;;
    s37-replay-min)  # (the Megatron routing-replay GPU test of s37-replay alone, one family: little device time was left)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py \
        -k "routing_replay and ${REPLAY_FAMILY:-qwen3moe}" --timeout 190 > "$OUT/pytest_gpu.txt" 2>&1
      grep -E "^FAILED|^SKIPPED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 12 ;;
    s38-replay)  # both routing replays on a GPU: megatron-core's RouterReplay against the torch backend's hooks
                 # (--use-routing-replay and --use-rollout-routing-replay, three MoE families each), then Qwen3-MoE
                 # flows replaying the built-in engine's routing (bf16 engine), both backends
      (timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py -k "routing_replay" \
         --timeout 400 > "$OUT/pytest_gpu.txt" 2>&1) &
      python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from model_families import \
save_model; save_model(Path('$BENCH_WORK/qwen3moe'), 'qwen3moe', 'examples/tiny-qwen2-arith')" > /dev/null 2>&1
      extra="--rollout-max-truncated-share 1 --rollout-max-response-len 24 --hf-checkpoint $BENCH_WORK/qwen3moe \
--use-rollout-routing-replay"
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron /tmp/rollflow_gpu_flow/ck_torch
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 240 \
        --extra "$extra" &
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 6 --out "$OUT" --timeout 240 --extra "$extra"
      wait; for g in "$OUT"/gpu_flow_demo_*; do mv "$g" "${g/gpu_flow_demo_/gpu_flow_r3_}"; done
      grep -E "^FAILED|^SKIPPED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 12 ;;
    s38-replay-min)  # (the GPU tests of s38-replay alone: little device time was left)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py -k "routing_replay" \
        --timeout 280 > "$OUT/pytest_gpu.txt" 2>&1
      grep -E "^FAILED|^SKIPPED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 12 ;;
    s40)  # after sessions 38–39, which no GPU reached: every GPU test (both routing replays, the backend's EP = 1
          # paths, the 12 Megatron GPU tests the CPU harness also runs) beside the R3 flows of s38-replay, then the
          # Megatron demo stopped after 4 rollouts and resumed by a new process from its optimizer checkpoint
      (timeout 560 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_flow.py tests/test_megatron_backend.py \
         tests/test_megatron_graphs.py --timeout 540 > "$OUT/pytest_gpu.txt" 2>&1) &
      python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from model_families import \
save_model; save_model(Path('$BENCH_WORK/qwen3moe'), 'qwen3moe', 'examples/tiny-qwen2-arith')" > /dev/null 2>&1
      extra="--rollout-max-truncated-share 1 --rollout-max-response-len 24 --hf-checkpoint $BENCH_WORK/qwen3moe \
--use-rollout-routing-replay"
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron /tmp/rollflow_gpu_flow/ck_torch
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 200 \
        --extra "$extra" & r3=$!
      python3 bench/gpu_flow.py demo --backend torch --num-rollout 6 --out "$OUT" --timeout 200 --extra "$extra"
      wait $r3; for g in "$OUT"/gpu_flow_demo_*; do mv "$g" "${g/gpu_flow_demo_/gpu_flow_r3_}"; done
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron
      for n in 4 8; do  # the same --save: the second run resumes at rollout 4 (a new process, a new backend)
        python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout $n --out "$OUT" --timeout 150 \
          --part "_to$n" --extra "--save-interval 2"
      done
      grep -h "esum\|Completed\|Failed" "$OUT"/gpu_flow_demo_megatron_bf16_to8.log | head -8
      wait; grep -E "^FAILED|^SKIPPED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 16 ;;
    s40-r3)  # routed experts recorded inside the engine's CUDA graphs: the GPU engine tests (the new one among them),
             # bench/gpu_r3_decode.py (graphs against the eager loop R3 batches ran on before), then the Megatron R3
             # flow of s40 on the graph decoder
      (timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_flow.py \
         -k "routed_experts or families or engine_on_cuda" --timeout 400 > "$OUT/pytest_gpu.txt" 2>&1) & tests=$!
      python3 bench/gpu_r3_decode.py --out "$OUT/gpu_r3_decode.json" > "$OUT/gpu_r3_decode.txt" 2>&1
      tail -n 6 "$OUT/gpu_r3_decode.txt"
      python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from model_families import \
save_model; save_model(Path('$BENCH_WORK/qwen3moe'), 'qwen3moe', 'examples/tiny-qwen2-arith')" > /dev/null 2>&1
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 200 \
        --part "_r3_graphs" --extra "--rollout-max-truncated-share 1 --rollout-max-response-len 24 \
--hf-checkpoint $BENCH_WORK/qwen3moe --use-rollout-routing-replay"
      wait $tests; grep -E "^FAILED|^SKIPPED|passed|failed" "$OUT/pytest_gpu.txt" | tail -n 16 ;;
    s40-r3-min)  # (s40-r3 without the flow and the other engine tests: little device time was left)
      (timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_flow.py -k "routed_experts" \
         --timeout 230 > "$OUT/pytest_gpu.txt" 2>&1) & tests=$!
      timeout 280 python3 bench/gpu_r3_decode.py --repeats 2 --out "$OUT/gpu_r3_decode.json" \
        > "$OUT/gpu_r3_decode.txt" 2>&1; tail -n 6 "$OUT/gpu_r3_decode.txt"
      wait $tests; grep -E "^FAILED|^SKIPPED|^E  |passed|failed" "$OUT/pytest_gpu.txt" | tail -n 16 ;;
    s41-reshardable)  # --dist-ckpt-optim-fully-reshardable on CUDA: the backend's save / load tests (both gathers),
                      # the Megatron GPU tests beside them, then the Megatron demo saved in that format after 4
                      # rollouts and resumed to 8 by a new process without the flag (the checkpoint's format counts)
      (timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py --timeout 400 \
         > "$OUT/pytest_gpu.txt" 2>&1) & tests=$!
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 4 --out "$OUT" --timeout 150 \
        --part "_to4" --extra "--save-interval 2 --dist-ckpt-optim-fully-reshardable"
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 8 --out "$OUT" --timeout 150 \
        --part "_to8" --extra "--save-interval 2"
      python3 -c "import torch, glob; [print(f, torch.load(f, weights_only=False)['format']) for f in \
sorted(glob.glob('/tmp/rollflow_gpu_flow/ck_megatron/**/backend.pt', recursive=True))]" 2>&1 | tee "$OUT/formats.txt"
      grep -h "esum\|Completed\|Failed" "$OUT"/gpu_flow_demo_megatron_bf16_to8.log | head -8
      wait $tests; grep -E "^FAILED|^SKIPPED|^E  |passed|failed" "$OUT/pytest_gpu.txt" | tail -n 16 ;;
    s41-sp)  # after --sequence-parallel (TP > 1 only, which one GPU cannot run): the TP = 1 paths it touched (experts
             # kept whole: ETP = 1, their TP mapping; the routing replays' call) in every Megatron GPU test, and an
             # R3 flow on a random Qwen3-MoE
      (timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py \
         tests/test_megatron_graphs.py --timeout 400 > "$OUT/pytest_gpu.txt" 2>&1) & tests=$!
      python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from model_families import \
save_model; save_model(Path('$BENCH_WORK/qwen3moe'), 'qwen3moe', 'examples/tiny-qwen2-arith')" > /dev/null 2>&1
      rm -rf /tmp/rollflow_gpu_flow/ck_megatron
      python3 bench/gpu_flow.py demo --backend megatron --bf16 --num-rollout 6 --out "$OUT" --timeout 200 \
        --part "_r3" --extra "--rollout-max-truncated-share 1 --rollout-max-response-len 24 \
--hf-checkpoint $BENCH_WORK/qwen3moe --use-rollout-routing-replay"
      wait $tests; grep -E "^FAILED|^SKIPPED|^E  |passed|failed" "$OUT/pytest_gpu.txt" | tail -n 16 ;;
    s42)  # slime's MIS helper built in and --deterministic-mode: the Megatron GPU tests; both demos with slime's
          # mis.yaml as it is (--tis-mode truncate, --use-rs, --rs-veto-threshold, --tis-batch-normalize) and their
          # per-rollout rejection / normalisation metrics; then each demo twice with --deterministic-mode
          # --sglang-enable-deterministic-inference (own work dirs, side by side) and the torch demo twice without
          # them: which per-rollout train / rollout metrics differ between the two runs of a pair. Each wave's
          # findings are written as soon as it ends (bench/s42_report.py), so a cut-off call keeps them.
      (timeout 400 python3 -m pytest -q -p no:cacheprovider -rs tests/test_megatron_backend.py --timeout 380 \
         > "$OUT/pytest_gpu.txt" 2>&1) & tests=$!
      det="--deterministic-mode --sglang-enable-deterministic-inference"
      demo() {  # BENCH_WORK backend part extra...
        local work=$1 backend=$2 part=$3; shift 3
        rm -rf "$work"; mkdir -p "$work"
        BENCH_WORK=$work python3 bench/gpu_flow.py demo --backend "$backend" $([ "$backend" = megatron ] && echo --bf16) \
          --num-rollout 6 --out "$OUT" --timeout 200 --part "$part" --extra "$*" > "$OUT/run_$part.txt" 2>&1
      }
      pids=()
      demo /tmp/g/mis_t torch _mis --use-tis --custom-config-path examples/mis.yaml & pids+=($!)
      demo /tmp/g/mis_m megatron _mis --use-tis --custom-config-path examples/mis.yaml & pids+=($!)
      demo /tmp/g/det_t_a torch _det_a $det & pids+=($!)
      demo /tmp/g/det_t_b torch _det_b $det & pids+=($!)
      wait "${pids[@]}"; pids=(); echo "== first wave done $(date +%T)"
      python3 bench/s42_report.py mis_t mis_m det_t_a:det_t_b 2>&1 | tee "$OUT/s42_wave1.txt"
      demo /tmp/g/det_m_a megatron _det_a $det & pids+=($!)
      demo /tmp/g/det_m_b megatron _det_b $det & pids+=($!)
      demo /tmp/g/plain_t_a torch _plain_a & pids+=($!)
      demo /tmp/g/plain_t_b torch _plain_b & pids+=($!)
      wait "${pids[@]}"; echo "== second wave done $(date +%T)"
      python3 bench/s42_report.py det_m_a:det_m_b plain_t_a:plain_t_b 2>&1 | tee "$OUT/s42_wave2.txt"
      wait $tests; grep -E "^FAILED|^SKIPPED|^E  |passed|failed" "$OUT/pytest_gpu.txt" | tail -n 16
      for f in "$OUT"/run_*.txt; do echo "-- $f"; tail -n 2 "$f"; done ;;
    s43)  # after s42 (every plain torch fp32 pair already equal): is --deterministic-mode what makes a pair equal
          # where the kernels are not? The Megatron bf16 demo twice without the flags, the torch bf16 demo twice
          # without and twice with them (own work dirs, side by side; bench/s42_report.py compares each pair)
      det="--deterministic-mode --sglang-enable-deterministic-inference"
      demo() {  # BENCH_WORK backend part extra...
        local work=$1 backend=$2 part=$3; shift 3
        rm -rf "$work"; mkdir -p "$work"
        BENCH_WORK=$work python3 bench/gpu_flow.py demo --backend "$backend" --bf16 \
          --num-rollout 6 --out "$OUT" --timeout 200 --part "$part" --extra "$*" > "$OUT/run_${backend}$part.txt" 2>&1
      }
      pids=()
      demo /tmp/g/plain_m_a megatron _plain_a & pids+=($!)
      demo /tmp/g/plain_m_b megatron _plain_b & pids+=($!)
      demo /tmp/g/plain_tb_a torch _plain_a & pids+=($!)
      demo /tmp/g/plain_tb_b torch _plain_b & pids+=($!)
      demo /tmp/g/det_tb_a torch _det_a $det & pids+=($!)
      demo /tmp/g/det_tb_b torch _det_b $det & pids+=($!)
      wait "${pids[@]}"; echo "== wave done $(date +%T)"
      python3 bench/s42_report.py plain_m_a:plain_m_b plain_tb_a:plain_tb_b det_tb_a:det_tb_b 2>&1 \
        | tee "$OUT/s43_pairs.txt"
      for f in "$OUT"/run_*.txt; do echo "-- $f"; tail -n 2 "$f"; done ;;
    s43-shape|s43-engine-only|s43-det-only)  # --deterministic-mode where plain runs may differ: the random Qwen2.5-0.5B shape (bf16, 3 small
                # rollouts: 16 prompts x 8, 256 tokens; --entropy-coef 0.01 so that the all-zero rewards of a random
                # model still give a gradient; micro-batches of 2,048 tokens), torch then Megatron, each twice
                # plain and twice with the flags,
                # side by side (4 runs a wave, one GPU); bench/s42_report.py compares each pair. s43-engine-only:
                # a pair per backend with --sglang-enable-deterministic-inference alone (which flag does it);
                # s43-det-only: a pair per backend with --deterministic-mode alone
      det="--deterministic-mode --sglang-enable-deterministic-inference"
      small="--rollout-batch-size 16 --global-batch-size 128 --rollout-max-response-len 256 --entropy-coef 0.01"
      small="$small --lr 1e-5 --num-rollout 3 --max-tokens-per-gpu 2048"  # 16384: four runs OOM on one H100
      mkdir -p /tmp/g/base
      python3 -c "import sys; sys.path[:0] = ['bench']; from pathlib import Path; import gpu_flow
gpu_flow.random_model('0.5b', Path('/tmp/g/base/qwen2_0.5b'))" > "$OUT/build_0.5b.txt" 2>&1
      shape() {  # work backend part extra...
        local work=$1 backend=$2 part=$3; shift 3
        rm -rf "$work"; mkdir -p "$work"; ln -s /tmp/g/base/qwen2_0.5b "$work/qwen2_0.5b"
        BENCH_WORK=$work python3 bench/gpu_flow.py shape --shape 0.5b --backend "$backend" --bf16 --out "$OUT" \
          --timeout 280 --part "$part" --extra "$small $*" > "$OUT/run_${backend}$part.txt" 2>&1
      }
      if [ "$step" = s43-det-only ]; then  # --deterministic-mode alone: a pair per backend in one wave
        pids=()
        for backend in torch megatron; do
          shape /tmp/g/s_${backend}_trn_a $backend _trn_a --deterministic-mode & pids+=($!)
          shape /tmp/g/s_${backend}_trn_b $backend _trn_b --deterministic-mode & pids+=($!)
        done
        wait "${pids[@]}"; echo "== done $(date +%T)"
        python3 bench/s42_report.py s_torch_trn_a:s_torch_trn_b s_megatron_trn_a:s_megatron_trn_b 2>&1 \
          | tee "$OUT/s43_det_only.txt"
        for f in "$OUT"/run_*.txt; do echo "-- $f"; tail -n 1 "$f"; done
        continue
      fi
      if [ "$step" = s43-engine-only ]; then  # which flag: the engine's alone, a pair per backend in one wave
        pids=()
        for backend in torch megatron; do
          shape /tmp/g/s_${backend}_eng_a $backend _eng_a --sglang-enable-deterministic-inference & pids+=($!)
          shape /tmp/g/s_${backend}_eng_b $backend _eng_b --sglang-enable-deterministic-inference & pids+=($!)
        done
        wait "${pids[@]}"; echo "== done $(date +%T)"
        python3 bench/s42_report.py s_torch_eng_a:s_torch_eng_b s_megatron_eng_a:s_megatron_eng_b 2>&1 \
          | tee "$OUT/s43_engine_only.txt"
        for f in "$OUT"/run_*.txt; do echo "-- $f"; tail -n 1 "$f"; done
        continue
      fi
      for backend in torch megatron; do
        pids=()
        shape /tmp/g/s_${backend}_plain_a $backend _plain_a & pids+=($!)
        shape /tmp/g/s_${backend}_plain_b $backend _plain_b & pids+=($!)
        shape /tmp/g/s_${backend}_det_a $backend _det_a $det & pids+=($!)
        shape /tmp/g/s_${backend}_det_b $backend _det_b $det & pids+=($!)
        wait "${pids[@]}"; echo "== $backend done $(date +%T)"
        python3 bench/s42_report.py s_${backend}_plain_a:s_${backend}_plain_b s_${backend}_det_a:s_${backend}_det_b \
          2>&1 | tee "$OUT/s43_shape_$backend.txt"
      done
      for f in "$OUT"/run_*.txt; do echo "-- $f"; tail -n 3 "$f"; done ;;
    s46-tests)  # after session 45's rendezvous change (a TCPStore held from the port pick to init_process_group:
                # Megatron's lone rank, the torch group, the weight-update group): the GPU tests of both backends
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_flow.py tests/test_megatron_backend.py \
        --timeout 280 > "$OUT/pytest_gpu.txt" 2>&1; tail -n 12 "$OUT/pytest_gpu.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
python3 bench/gpu_flow.py report --out "$OUT" 2>&1 | tail -12
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then (cd "$OUT" && tar czf results.tgz --remove-files -- *); ls -la "$OUT"; fi
