#!/usr/bin/env bash
# The device check (see bench/device_check.py): `prepare DIR` on the CPU machine, `run DIR` on the device machine
# (a bare image: its own python3; DIR carried with the working tree), `run DIR --dry-run` on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
exec "$PY" bench/device_check.py "$@"
