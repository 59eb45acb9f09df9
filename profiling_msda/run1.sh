#!/bin/bash
# MSDA device run 1: variant timings, ncu counters (sca), GPU tests. Everything also under $OUT.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee $OUT/smi.txt
python3 profiling_msda/msda_variants.py --reps 10 > $OUT/variants.txt 2>&1; tail -60 $OUT/variants.txt
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
SECS="--section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats"
ARGS="profiling_msda/msda_variants.py --ncu --cases bevformer-base-sca --dtypes f32,f16 --fwd 0,4 --bwd 0:0,4:0,0:2"
timeout 80 $NCU --clock-control none --kernel-name regex:'(forward|backward)_kernel' --launch-count 10 $SECS \
  --metrics lts__t_sectors_op_red.sum,l1tex__data_pipe_lsu_wavefronts.sum,smsp__inst_executed.sum \
  --csv --page raw python3 $ARGS > $OUT/ncu_raw.csv 2> $OUT/ncu_err.txt
python3 profiling_msda/ncu_summary.py $OUT/ncu_raw.csv 2>&1 | tee $OUT/ncu_summary.txt
tail -3 $OUT/ncu_err.txt
timeout 110 python3 -m pytest -q -x -m gpu -n 8 -p no:cacheprovider tests/ops/test_multi_scale_deformable_attn.py > $OUT/tests.txt 2>&1
tail -25 $OUT/tests.txt
