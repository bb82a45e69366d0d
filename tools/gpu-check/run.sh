#!/usr/bin/env bash
# Weft's real-NCCL GPU check, run on a GPU machine from the directory
# tools/gpu-check/stage.sh staged. For each staged NCCL: two ranks on GPU 0,
# each with its own NCCL_HOSTID (so NCCL treats them as two hosts) and
# NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (so it must use the net plugin),
# over Weft on tcp over lo; once with NCCL_NET_GDR_LEVEL=LOC (host bounce)
# and once with GPUDirect allowed. Prints per NCCL version the lines where
# NCCL names its net plugin and transports ("via NET/Weft"), the algorithms
# it picked, bus bandwidth per size and collective, and PASS/FAIL.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export WEFT_PROVIDER=${WEFT_PROVIDER:-tcp} WEFT_IFACE=${WEFT_IFACE:-lo} FI_TCP_IFACE=${FI_TCP_IFACE:-lo}
status=0
for nccl in "$here"/nccl-*; do
  v=${nccl##*/nccl-}
  for gdr in LOC allowed; do
    log=$(mktemp -d)
    echo "=== NCCL $v, GPUDirect: $gdr"
    id="$log/id"
    for r in 0 1; do
      (
        export LD_LIBRARY_PATH="$nccl:$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export NCCL_NET_PLUGIN=weft NCCL_HOSTID="weft-gpu-check-$r" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
        export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH,TUNING
        if [ "$gdr" = LOC ]; then export NCCL_NET_GDR_LEVEL=LOC; fi
        exec "$here/bin/nccl_check" "$r" 2 "$id"
      ) >"$log/out.$r" 2>"$log/err.$r" &
    done
    wait -n || status=1
    wait || status=1
    grep -h -E "NET/Plugin|Using network|via NET|NET/Weft : device|ptrSupport|DMA-BUF|FI_OPT_CUDA_API_PERMITTED|Algo|Protocol" "$log"/out.* "$log"/err.* |
      sed 's/^[^ ]* [^ ]* //' | sort -u | head -40
    grep -v "NCCL INFO" "$log/out.0"
    if ! grep -q "via NET/Weft" "$log"/out.* "$log"/err.*; then
      echo "FAIL: NCCL did not use Weft (no \"via NET/Weft\")"
      status=1
    fi
    tail -n 3 "$log/err.0" "$log/err.1" | grep -v "NCCL INFO" || true
  done
done
echo "gpu-check: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
