# python.sh - sourced by the sbatch templates before anything starts: sets PY to an interpreter
# that can import mshpc and torch, or says in one line what to do and exits 2 (a user error:
# never requeued). Without it, a job submitted outside its venv failed deep inside the
# supervisor, with a ModuleNotFoundError from a rank that "vanished".
#
# Tried in order: MSHPC_PYTHON when it is set (then only it); MSHPC_HOME/.venv/bin/python (the
# checkout's venv, which `make` creates); python3 on PATH (an activated venv). The template that
# sources this file sets MSHPC_HOME.

if [ -n "${MSHPC_PYTHON:-}" ]; then
  candidates=("$MSHPC_PYTHON")
else
  candidates=("$MSHPC_HOME/.venv/bin/python" python3)
fi
FIND_MSHPC_AND_TORCH='import importlib.util
for name in ("mshpc", "torch"):
    if importlib.util.find_spec(name) is None:
        raise SystemExit(f"ModuleNotFoundError: No module named {name!r}")'
PY='' tried=''
for candidate in "${candidates[@]}"; do
  if ! command -v "$candidate" >/dev/null; then
    tried+="; $candidate: not found"
    continue
  fi
  # found, not imported: importing torch takes seconds on every job start; a rare venv that
  # holds both but cannot import them still fails, with the import's own traceback in the log
  if why=$("$candidate" -c "$FIND_MSHPC_AND_TORCH" 2>&1 >/dev/null); then
    PY=$candidate
    break
  fi
  tried+="; $candidate: $(tail -n 1 <<<"$why")"
done
if [ -z "$PY" ]; then
  echo "mshpc: error: no python here can import mshpc and torch (${tried#; }): run \`make\` in" \
       "$MSHPC_HOME to create its .venv, or submit with MSHPC_PYTHON=/path/to/venv/bin/python" >&2
  exit 2
fi
echo "mshpc: python $PY"
