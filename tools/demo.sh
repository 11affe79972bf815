#!/usr/bin/env bash
# Sets up everything (tools/setup.sh) and runs the training demo: a small GPT trained under a
# device budget half its model data, so chunks move (tools/demo_train.py; --help lists options,
# e.g. --profile DIR for a memory report). The memory-tier demo is tools/demo_tiers.py.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec .venv/bin/python tools/demo_train.py "$@"
