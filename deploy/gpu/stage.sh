#!/bin/bash
# Usage (on the device, from the repo root): bash .gpu/bin/stage.sh N
# Copies part N (.gpu/pN, carried by that call) into /tmp/gpu-stage and checks its sha256 sums.
# Part of the GPU bundle that deploy/gpu/build.sh makes (docs/DEPLOYING.md, "Running a suite on a
# lent GPU machine"); the device's /tmp survives only while the machine stays warm (30 s).
set -euo pipefail
N=${1:?usage: stage.sh N}
HERE=$(cd "$(dirname "$0")/.." && pwd)
SRC=$HERE/p$N
STAGE=${GPU_STAGE:-/tmp/gpu-stage}
[ -f "$SRC/SHA256SUMS.p$N" ] || { echo "stage: $SRC/SHA256SUMS.p$N missing (was .gpu/p$N carried?)" >&2; exit 3; }
mkdir -p "$STAGE"
cp -f "$SRC"/* "$STAGE"/
(cd "$STAGE" && sha256sum -c --quiet "SHA256SUMS.p$N") || { echo "stage: checksum FAILED for part $N" >&2; rm -f "$STAGE/SHA256SUMS.p$N"; exit 4; }
echo "stage: part $N OK ($(du -sh "$SRC" | cut -f1)); staged so far: $(cd "$STAGE" && echo SHA256SUMS.p*)"
df -h /tmp | tail -1
