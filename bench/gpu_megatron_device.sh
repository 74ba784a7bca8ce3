#!/bin/bash
# final device call: bench single (GPU 0) ∥ GPU pytest + transformers baseline (GPU 1); layouts DP2/TP2/PP2; report
# Run on the lent nvidia-h200-x2 machine (the device tool) from the repository root, with the megatron-core
# 0.16.1 cp312 wheel and its pure-python deps in the ignored .gpu_stage/whl/ (carry [".gpu_stage"]).
# Files land in $OUT: single.json, gpu_megatron.json (report incl. layouts), hf_baseline.json, pytest_gpu.txt,
# logs.txt, report.txt.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_stage/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used --format=csv > $OUT/nvidia_smi.txt 2>&1
(export CUDA_VISIBLE_DEVICES=1; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_megatron_graphs.py tests/test_megatron_backend.py tests/test_megatron_cpu_model.py tests/test_megatron_packed.py tests/test_megatron_mapping.py > $OUT/pytest_gpu.txt 2>&1; timeout 120 python3 bench/gpu_hf_baseline.py --out $OUT > /tmp/hf.log 2>&1) &
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 bench/gpu_megatron.py single --out $OUT --variants no_cuda_graphs,no_fused_swiglu,no_wgrad_fusion,no_fused_log_probs,none > /tmp/single.log 2>&1
wait
for l in dp2 tp2 pp2; do case $l in tp2) a="--tp 2";; dp2) a="--tp 1";; pp2) a="--pp 2";; esac; timeout 75 python3 -m torch.distributed.run --nproc-per-node 2 bench/gpu_megatron.py layout $a --out $OUT >> /tmp/layout.log 2>&1; done
python3 bench/gpu_megatron.py report --out $OUT --write $OUT > $OUT/report.txt 2>&1
rm -f $OUT/layout_*.json
(echo "== single.log"; grep -v "UserWarning\|warnings.warn\|it/s\]" /tmp/single.log; echo "== layout.log"; grep -v "UserWarning\|warnings.warn" /tmp/layout.log | tail -60; echo "== hf.log"; cat /tmp/hf.log) > $OUT/logs.txt
cat $OUT/report.txt; tail -2 $OUT/pytest_gpu.txt; tail -3 /tmp/hf.log
