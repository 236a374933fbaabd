#!/usr/bin/env bash
# Runs PyTorch's own pipelining tests against torch and against pipeline_ext (CPU, Gloo).
#   tools/run_torch_pipelining_tests.sh --torch-src ~/src/pytorch [--files test_stage.py] [-k EXPR] [--json out.json]
# See tools/run_torch_pipelining_tests.py for what is ported and how.
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/run_torch_pipelining_tests.py" "$@"
