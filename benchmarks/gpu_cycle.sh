#!/usr/bin/env bash
# One device call's worth of the CUDA cycle: install, tests, selftest, benchmarks; logs under $OUT.
#   bash benchmarks/gpu_cycle.sh test     # install + CUDA tests + selftest + backends
#   bash benchmarks/gpu_cycle.sh bench    # end-to-end figures (qwen3-8b preset), prefill GEMMs, kestrel bench
# On the lent H200 the image's bare pip/kestrel belong to another interpreter: always go through `python -m`.
set -uo pipefail
OUT=${OUT:-/tmp/kestrel-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() { echo "\$ $*" >> "$OUT/commands.txt"; "$@"; }
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
case "${1:-test}" in
test)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/smi.txt" 2>&1
    run python -m kestrel_core.cli backends --json > "$OUT/backends.json" 2>&1
    run python -m pytest -q -p no:randomly tests/kestrel_cuda 2>&1 | tail -n 40 | tee "$OUT/pytest_cuda.log"
    run python -m kestrel_core.cli selftest --backend cuda --json > "$OUT/selftest_cuda.json" 2>&1
    python -c "import json; d=json.load(open('$OUT/selftest_cuda.json')); print('selftest cuda:', d['passed'], 'passed,', d['failed'], 'failed')"
    ;;
bench)
    run python benchmarks/cuda_e2e.py --quant q8 --window 1,4,16 --sweep "" --json "$OUT/e2e_q8.json" 2>&1 | tail -n 30
    run python benchmarks/cuda_e2e.py --quant q4 --window "" --sweep "" --json "$OUT/e2e_q4.json" 2>&1 | tail -n 12
    for q in q8 q4; do
        run python -m kestrel_core.cli bench --preset qwen3-8b --backend cuda --quant $q --prompt-tokens 512 \
            --decode-tokens 128 --runs 3 2>&1 | tail -n 14
    done
    ;;
esac
