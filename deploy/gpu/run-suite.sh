#!/bin/bash
# Usage (on the device, from the repo root, as one call's whole command):
#   [GPU_STAGE_PART=N] [GPU_LIMIT=560] bash .gpu/bin/run-suite.sh SUITE [deploy.experiments options]
# e.g. GPU_STAGE_PART=3 bash .gpu/bin/run-suite.sh inclusivefl-proportions --preset gpu \
#        --only "InclusiveFL 1:1:1" --only "ExclusiveFL 1:1:1" --first-seed 43 --seeds 1
# Stages part N first when GPU_STAGE_PART=N (the bundle's last part, carried by this call), runs
# setup.sh unless this warm machine is set up already, then `$GPU_PY -m deploy.experiments ARGS --out
# /tmp/gpu-results/SUITE-PRESET`, stopped with SIGINT GPU_LIMIT seconds after this script started
# (the launcher then stops its SuperLink). A run folder left without summary.csv by an earlier cut
# call is moved aside to runs/NAME.cutS first, so the runner restarts it whole (finished runs are
# skipped). /tmp/gpu-results, minus checkpoints/, is tarred to $OUT/gpu-results.tar.gz every 15 s
# and at the end; the suite's log is gpu-results/experiments.log in it, $OUT/setup.log beside it.
# Exit status: the runner's; 10 when GPU_LIMIT cut it; 9 when staging or setup failed.
# Part of the GPU bundle (deploy/gpu/build.sh; docs/DEPLOYING.md, "Running a suite on a lent GPU machine").
set -o pipefail
[ $# -ge 1 ] || { echo "usage: [GPU_STAGE_PART=N] [GPU_LIMIT=560] bash .gpu/bin/run-suite.sh SUITE [options]" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/gpu-out}
LIMIT=${GPU_LIMIT:-560}
R=${GPU_RESULTS:-/tmp/gpu-results}
SITE=${GPU_SITE:-/tmp/site}
ENV_FILE=${GPU_ENV_FILE:-/tmp/gpu-env.sh}
mkdir -p "$OUT" "$R"
# the results folder deploy.experiments would pick itself (SUITE-PRESET), under $R
PRESET=cpu
prev=
for a in "$@"; do
  case $a in
    --out|--out=*) echo "run-suite: --out is set by this script ($R/SUITE-PRESET)" >&2; exit 2 ;;
    --preset=*) PRESET=${a#--preset=} ;;
  esac
  [ "$prev" = --preset ] && PRESET=$a
  prev=$a
done
S=$R/$(basename "$1" .toml)-$PRESET

nvidia-smi -L || true
python3 -c 'import sys,torch;print(sys.version);print("torch",torch.__version__,"cuda",torch.version.cuda,torch.cuda.is_available())' || true
if [ -n "${GPU_STAGE_PART:-}" ]; then
  bash "$HERE/stage.sh" "$GPU_STAGE_PART" || exit 9
fi
if [ -f "$SITE/.gpu-setup-done" ] && [ -f "$ENV_FILE" ]; then
  echo "run-suite: $SITE is set up already (warm machine): setup skipped"
else
  bash "$HERE/setup.sh" 2>&1 | tee "$OUT/setup.log" || { echo "run-suite: setup failed (a fresh machine needs every part staged again)" >&2; exit 9; }
fi
# shellcheck disable=SC1090
. "$ENV_FILE"

mkdir -p "$S/runs"
for d in "$S"/runs/*/; do
  case $d in *.cut[0-9]*/) continue ;; esac
  [ -d "$d" ] && [ ! -f "$d/summary.csv" ] && mv "$d" "${d%/}.cut$SECONDS"
done
snap() {
  tar -czf "$OUT/gpu-results.tmp" --exclude=checkpoints -C "$(dirname "$R")" "$(basename "$R")" 2>/dev/null \
    && mv -f "$OUT/gpu-results.tmp" "$OUT/gpu-results.tar.gz"
}
(while sleep 15; do snap; done) &
L=$!
left=$((LIMIT - SECONDS))
if [ "$left" -lt 30 ]; then
  echo "run-suite: only ${left} s left of GPU_LIMIT=${LIMIT} s: suite not started" | tee -a "$R/experiments.log"
  rc=124
else
  echo "run-suite: $GPU_PY -m deploy.experiments $* --out $S (limit ${left} s)" | tee -a "$R/experiments.log"
  timeout -s INT -k 15 "$left" "$GPU_PY" -m deploy.experiments "$@" --out "$S" 2>&1 | tee -a "$R/experiments.log"
  rc=$?
fi
kill "$L"
wait "$L" 2>/dev/null
snap
echo "run-suite: experiments rc=$rc (124 = cut by GPU_LIMIT) after ${SECONDS} s"
ls "$S" "$S/runs"
[ "$rc" -eq 124 ] && exit 10
exit "$rc"
