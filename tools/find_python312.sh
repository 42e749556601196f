#!/usr/bin/env bash
# Create (or reuse) a Python 3.12 virtual environment at $1. Fails loudly when no 3.12 exists.
set -euo pipefail
venv="${1:-.venv}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)'; then
  exit 0
fi
candidates=()
[ -n "${PYTHON312:-}" ] && candidates+=("$PYTHON312")
command -v python3.12 >/dev/null 2>&1 && candidates+=("$(command -v python3.12)")
if command -v pyenv >/dev/null 2>&1; then
  root="$(pyenv root)"
  for d in "$root"/versions/3.12*; do [ -x "$d/bin/python3.12" ] && candidates+=("$d/bin/python3.12"); done
fi
for d in /root/.pyenv/versions/3.12* /usr/local/bin /usr/bin; do
  [ -x "$d/bin/python3.12" ] && candidates+=("$d/bin/python3.12")
  [ -x "$d/python3.12" ] && candidates+=("$d/python3.12")
done
for py in "${candidates[@]}"; do
  if "$py" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
    echo "Creating $venv with $py"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    exit 0
  fi
done
cat >&2 <<MSG
ERROR: msar-jax needs Python 3.12 (jax 0.11.2 requires Python >= 3.12) and none was found.
Tried: \$PYTHON312, python3.12 on PATH, pyenv versions 3.12.*.
Install one (e.g. 'pyenv install 3.12.1') or point PYTHON312 at a python3.12 binary.
MSG
exit 1
