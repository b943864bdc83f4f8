#!/usr/bin/env bash
# Profile each case of ncu_cases.py with Nsight Compute (source counters, warp state, memory
# tables; line info and source embedded), the Triton cache of the run kept beside the reports.
#   experiments/probes/ncu_cases.sh OUT_DIR [CASE ...]
set -u
out=${1:?usage: ncu_cases.sh OUT_DIR [CASE ...]}; shift
mkdir -p "$out"
cases=${*:-gemm gluon put put_noline hint0 hint1 mxfp4 torch}
declare -A pat=([gemm]=_gemm_tma [gluon]=_gemm_ws [put]=put_kernel [put_noline]=put_kernel
                [hint0]=remote_store_kernel [hint1]=remote_store_kernel [mxfp4]=_moe_mxfp4_down_kernel
                [torch]='nvjet|gemm|cutlass|sm90')
for c in $cases; do
  env_extra=""; case_name=$c
  if [ "$c" = put_noline ]; then env_extra="TRITON_DISABLE_LINE_INFO=1"; case_name=put; fi
  start=$(date +%s)
  env $env_extra TRITON_CACHE_DIR="$out/cache_$c" timeout 240 ncu --clock-control none \
    --section SourceCounters --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
    --import-source yes -k "regex:${pat[$c]}" --launch-count 1 -f -o "$out/$c" \
    python3 "$(dirname "$0")/ncu_cases.py" "$case_name" > "$out/$c.log" 2>&1
  echo "$c: rc $? in $(( $(date +%s) - start )) s, $(du -h "$out/$c.ncu-rep" 2>/dev/null | cut -f1)"
done
