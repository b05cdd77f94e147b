#!/usr/bin/env bash
# The speed runs a GPU machine is for, in one go: workload (x) on the GPU under bf16-mixed (floor, fedlight
# sequential, the vectorised and compiled cohort, pfl-research) and workload (a) on the same machine's CPU cores,
# one thread per engine (floor, fedlight, compiled whole steps, pfl-research). The reports and the consoles go to
# the folder given (default benchmarks/speed/out/gpu), with the GPU's utilisation and memory sampled every second.
#
#   bash benchmarks/speed/gpu_runs.sh [folder] [rounds] [repeats] [workloads: "x a" by default]
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-benchmarks/speed/out/gpu}" rounds="${2:-6}" repeats="${3:-2}" workloads="${4:-x a}"
mkdir -p "$out"
python=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/machine.txt"
$python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" | tee -a "$out/machine.txt"
nproc | tee -a "$out/machine.txt"
nvidia-smi dmon -s um -d 1 >"$out/gpu_dmon.txt" 2>&1 &
dmon=$!
work=$(mktemp -d)
# (x) on cores 0-7 and the GPU, (a) on cores 8-15: the two never share a core
x=
[[ $workloads == *x* ]] && taskset -c 0-7 $python benchmarks/speed/cross_device.py --accelerator cuda --precision bf16-mixed \
  --engines floor1,fedlight1,pfl1,batched1 --rounds "$rounds" --repeats "$repeats" --out "$work/x" >"$out/x_console.txt" 2>&1 &
[[ $workloads == *x* ]] && x=$!
[[ $workloads == *a* ]] && taskset -c 8-15 $python benchmarks/speed/synthetic_mlp.py --engines floor1,fedlight1,pfl1,compiled1 \
  --rounds "$rounds" --repeats "$repeats" --out "$work/a" >"$out/a_console.txt" 2>&1
[[ -n $x ]] && wait $x
kill $dmon
cp "$work/x/cross_device.json" "$work/a/synthetic_mlp.json" "$out/" 2>/dev/null
tail -n 45 "$out/x_console.txt" "$out/a_console.txt"
