#!/usr/bin/env bash
# The exit race behind "terminate called without an active exception": a 4-rank Gloo script
# that ends right after its all-gathers, run N times beside two CPU hogs, once ending plainly
# and once set up through hapt_hf (whose exit guard joins Gloo's worker threads at exit).
#   bash scripts/exit_race.sh [N]     -> "plain: aborted A of N", "hapt_hf: aborted B of N"
set -u
N=${1:-20}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
cat >"$TMP/race.py" <<PY
import sys
sys.path.insert(0, "$ROOT")
import torch, torch.distributed as dist
if sys.argv[1] == "hapt_hf":
    from hapt_hf.pipeline import init_distributed
    init_distributed(backend="gloo")
else:
    dist.init_process_group("gloo")
sub = dist.new_group([0, 1, 2, 3])
for _ in range(3):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"x": torch.randn(1000)}, group=sub)
    dist.all_gather_object(out, {"x": torch.randn(1000)})
PY
(while :; do :; done) & H1=$!
(while :; do :; done) & H2=$!
trap 'kill $H1 $H2 2>/dev/null; rm -rf "$TMP"' EXIT
for mode in plain hapt_hf; do
  aborted=0
  for i in $(seq "$N"); do
    OMP_NUM_THREADS=1 timeout 120 python3 -m torch.distributed.run --nproc_per_node 4 \
      --master_port $((29650 + i % 40)) "$TMP/race.py" "$mode" >"$TMP/log" 2>&1 \
      || aborted=$((aborted + 1))
  done
  echo "$mode: aborted $aborted of $N"
done
