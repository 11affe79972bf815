#!/usr/bin/env bash
# Sets up everything (tools/setup.sh) and runs the demo. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec .venv/bin/python tools/demo_tiers.py "$@"
