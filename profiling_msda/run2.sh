#!/bin/bash
# MSDA device run 2 (final): GPU tests, quick harness benchmark, per-dtype kernel timings.
export PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -x -m gpu -n 8 -p no:cacheprovider tests/ops/test_multi_scale_deformable_attn.py > $OUT/tests.txt 2>&1
echo "tests rc=$?"; grep -v "PytestBenchmarkWarning\|warner(" $OUT/tests.txt | tail -12
timeout 80 python3 -m benchmarks.bench_multi_scale_deformable_attn --quick --no-write --cases '^(bevformer|deformable-detr)' > $OUT/bench.txt 2> $OUT/bench_err.txt
echo "bench rc=$?"; cat $OUT/bench.txt; tail -2 $OUT/bench_err.txt
timeout 45 python3 profiling_msda/msda_variants.py --reps 10 --fwd 0 --bwd 0:2,0:0 > $OUT/variants.txt 2>&1
echo "variants rc=$?"; cat $OUT/variants.txt
