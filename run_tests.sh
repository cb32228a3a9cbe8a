#!/usr/bin/env bash
# The test command from the README: sets up the environment, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh
exec ${PYTHON:-python3} -m pytest -q -p no:cacheprovider "$@"
