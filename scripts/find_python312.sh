#!/usr/bin/env bash
# Prints the path of a working Python 3.12 interpreter, or fails with a clear message.
# Looks on PATH first (skipping pyenv shims that are not activated), then in pyenv's versions folder.
set -u
candidates=()
command -v python3.12 >/dev/null 2>&1 && candidates+=("$(command -v python3.12)")
command -v python3 >/dev/null 2>&1 && candidates+=("$(command -v python3)")
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
for p in $(ls -d "$root"/versions/3.12.*/bin/python3 2>/dev/null | sort -V -r); do candidates+=("$p"); done
for c in "${candidates[@]}"; do
  if "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; then
    echo "$c"; exit 0
  fi
done
echo "error: no working Python 3.12 found (looked for python3.12/python3 on PATH and in $root/versions/3.12.*);" \
     "install one, e.g. 'pyenv install 3.12'" >&2
exit 1
