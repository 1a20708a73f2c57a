#!/usr/bin/env bash
# Runs the whole test suite N times in a row (default 5); the last H runs (default 3) with two
# CPU-bound processes beside it, as a flakiness check. One summary line per run on stdout; each
# run's log in $LOGDIR (default ./suite-runs). Exits non-zero if any run failed.
#   bash scripts/repeat_suite.sh [N] [H]
set -u
cd "$(dirname "$0")/.."
n=${1:-5}; hogged=${2:-3}; logs=${LOGDIR:-suite-runs}; mkdir -p "$logs"
export OMP_NUM_THREADS=1
failed=0
for i in $(seq 1 "$n"); do
  pids=()
  if [ "$i" -gt $((n - hogged)) ]; then
    for _ in 1 2; do python3 -c 'while True: pass' & pids+=($!); done
  fi
  start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider > "$logs/run$i.log" 2>&1; rc=$?
  [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}"
  [ $rc -eq 0 ] || failed=1
  echo "run $i: rc=$rc hogs=${#pids[@]} wall=$(( $(date +%s) - start ))s load=$(cut -d' ' -f1 /proc/loadavg) $(tail -1 "$logs/run$i.log")"
done
exit $failed
