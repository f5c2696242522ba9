#!/usr/bin/env bash
# Everything that needs a GPU, in one go (run on a CUDA machine from the repository root):
#   bash benchmarks/gpu_suite.sh [env|tests|fit|bench|train|ladder|cpucheck|all]   (results under $OUT, default ./gpu-out)
# Uses the machine's own torch; torchao (and tomli-w, which ampkit needs) from .whl/ if carried there.
# cpucheck: issue 34 §6's CPU step cost on the GPU host's own CPU (an Intel Xeon with AMX on these
# machines), pinned to two cores like the 2-core CI machine; it may run beside the ladder (other cores).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1 && [[ ! -e /tmp/site/.ampkit-wheels ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.ampkit-wheels
fi
[[ -e /tmp/site/.ampkit-wheels ]] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
what=${1:-all}
if [[ $what == env || $what == all || $what == tests ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  python3 -c "import fastapi" 2>&1 | tail -1  # the CUDA tests must collect without the serve extra
  lscpu | grep -E '^(Model name|CPU\(s\))'; grep -o -w -E 'amx_bf16|avx512_bf16|avx512_fp16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
fi
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.txt" | tail -25
fi
if [[ $what == fit || $what == all ]]; then
  python3 benchmarks/fit.py --sizes small,medium,large --precisions fp32,bf16,fp16,bf16-pure --batch_size 8 \
    --budget 8GiB --search_sizes large --json "$OUT/fit.json" 2>&1 | tee "$OUT/fit.txt" | tail -30
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m ampkit bench --model gpt --size large --batch_size 8 --steps 20 --repeats 3 --device cuda \
    --precisions fp32,tf32,bf16,fp16,bf16-pure,fp16-pure,fp8 --json "$OUT/bench_eager.json" 2>&1 | tail -22
  python3 -m ampkit bench --model gpt --size large --batch_size 8 --steps 20 --repeats 3 --device cuda --compile \
    --precisions bf16,fp8 --json "$OUT/bench_compile.json" 2>&1 | tail -14
fi
if [[ $what == train || $what == all ]]; then
  python3 -m ampkit train --model gpt --size large --batch_size auto --memory_budget 8GiB --precision bf16 \
    --steps 5 --device cuda --log_dir "$OUT/auto8" --json 2>"$OUT/auto8.err" | tail -40
  tail -5 "$OUT/auto8.err"
fi
if [[ $what == ladder || $what == all ]]; then
  # the memory ladder: B/param, step peak and whole-step time per rung (GPT-2 124M, batch 8 x 1024), then
  # the deepest GPT-2-block stack that really trains per rung on this GPU (docs/benchmarks.md)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${LADDER_SECONDS:-420}" python3 benchmarks/gpu_ladder.py \
    --part all --batch 8 --seconds "${LARGEST_SECONDS:-230}" --json "$OUT/ladder.json" 2>&1 | tee "$OUT/ladder.txt"
fi
if [[ $what == cpucheck || $what == all ]]; then
  taskset -c "${CPU_CORES:-14,15}" python3 benchmarks/overhead.py --cpu-check --blocks "${CPU_BLOCKS:-60}" --steps 5 \
    --warmup 10 --json "$OUT/cpu_check.json" 2>&1 | tee "$OUT/cpu_check.txt" | tail -14
fi
