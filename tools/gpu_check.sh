#!/usr/bin/env bash
# Runs every CUDA path of pipeline_ext on a real GPU and writes a Markdown report.
#
#   tools/gpu_check.sh [--budget SECONDS] REPORT_DIR
#   GPU_CHECK_DRY=1 tools/gpu_check.sh --budget 420 REPORT_DIR   # the plan and its timeouts, on any machine
#
# Made for a bare GPU machine with its own CUDA build of torch, nvcc, pytest and
# hypothesis, and no network: it builds against the torch that is there (any
# version: nothing is downloaded), then runs, in this order (what has never run
# elsewhere first, so a short lease checks it), each step logged to
# REPORT_DIR/logs/ (pytest steps also as junit XML) and summarised in
# REPORT_DIR/report.md, which is rewritten after every step (a run cut short
# still leaves everything done so far):
#   1. build of the CUDA extension (MAX_JOBS=nproc, its seconds in the table); torch, CUDA and device versions
#   1b. tools/nccl_probe.py: two plain ranks sharing cuda:0 over NCCL (init, all_reduce, send/recv, barrier),
#      each NCCL setting in turn until one gets through (NCCL's own logs under logs/nccl_probe/)
#   2. the multi-process tests with every stage on cuda:0 over NCCL (each rank its own NCCL host)
#   2b. pipeline x tensor parallel on cuda ranks: pp=2 x tp=1 (DTensor activations cross stages over NCCL;
#      pp=2 x tp=2 needs 4 GPUs, pp=1 x tp=2 is no pipeline): tests/parallel/test_tensor_parallel.py -m cuda
#   2c. the NCCL ordering model (tests/schedules/test_nccl_order.py, on the CPU) and its verdict against NCCL itself:
#      torch PR 195760's looped schedule (4 ranks sharing cuda:0), which the model says cycles on one shared
#      communicator and not under the runtime's choices, trains (tests/runtime/test_steady_state.py)
#   2d. steady-state steps on cuda:0 over NCCL (tests/runtime/test_steady_state.py -m cuda): 1F1B, ZB-H1 and
#      interleaved 1F1B, no host synchronisation after the discovery steps (set_sync_debug_mode("error"))
#      and the same messages every step
#   3. pytest -m "cuda and not slow" (single process: Pipe on cuda:0, every schedule x checkpoint mode x fp32/bf16)
#   4. the CUDA IPC transport (transport="ipc", 2-4 processes sharing cuda:0): tests/comm/test_ipc_gpu.py,
#      tests/comm/test_ipc_transport.py
#   5. benchmarks/bench_pipeline.py --device cuda: 2-rank 1F1B, ours vs torch over NCCL
#   5b. benchmarks/bench_zb_sac.py --device cuda: the zero-bubble gain over 1F1B, measured and simulated,
#      with SAC and without (2 ranks sharing cuda:0)
#   6. benchmarks/bench_transport.py --device cuda: IPC vs NCCL round trips, 4 B .. 64 MiB
#   7. tools/gpu_sync_count.py --ranks 2: host-device synchronisations in a known multi-process step
#   8. tools/gpu_sync_count.py: synchronisations in one Pipe.step
#   9. benchmarks/bench_kernels.py and benchmarks/bench_overlap.py on CUDA
#  10. compute-sanitizer memcheck and racecheck over the CUDA tests
#  11. the whole suite, in the time left
# Beside them, from step 1b on, on two cores of their own (when the machine has 8 or more; every other step
# keeps off them): benchmarks/bench_long_context.py --ranks 2, the long-context speed on CPU ranks, which a
# machine with quiet cores measures better than a shared 2-core VM (its speed criterion, docs/training.md).
# --budget SECONDS: the whole run fits in it. Each step's timeout is the
# smaller of its own cap and what is left of the budget (less 15 s for the
# report); a step with under 30 s left is not started and says so. Without
# --budget every step has its cap and the whole suite runs until
# GPU_CHECK_DEADLINE (seconds since the start, default 1800).
# GPU_CHECK_DRY=1 prints the plan instead: the steps in order, each with the
# timeout it would get if every earlier step took its usual time; nothing is
# built or run, no GPU is needed.
# Without a GPU (and not dry) it says so and exits 0. Exit status: 0 when every
# step passed. Every step runs even when an earlier one failed (except after a
# failed build).
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=""
while [ $# -gt 1 ]; do
  case $1 in
    --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
    --budget=*) BUDGET=${1#--budget=}; shift ;;
    *) echo "usage: tools/gpu_check.sh [--budget SECONDS] REPORT_DIR" >&2; exit 2 ;;
  esac
done
OUT_DIR=${1:?usage: tools/gpu_check.sh [--budget SECONDS] REPORT_DIR}
mkdir -p "$OUT_DIR/logs"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOGS=$OUT_DIR/logs
REPORT=$OUT_DIR/report.md
PY=${PYTHON:-python3}
QUICK=${GPU_CHECK_QUICK:-0}  # 1: smaller benchmarks (a smoke run of this script)
SKIP=" ${GPU_CHECK_SKIP:-} "  # step names to leave out while iterating, e.g. "pytest_all sanitizer_racecheck"
DRY=${GPU_CHECK_DRY:-0}
DRY_CLOCK=0  # dry run: seconds the steps before this one usually take
export PYTHONUNBUFFERED=1

if [ "$DRY" != 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  msg="gpu_check: no GPU (torch.cuda.is_available() is False, or torch is missing): nothing was checked"
  echo "$msg"
  printf '# GPU check\n\n%s.\n' "$msg" >"$REPORT"
  exit 0
fi
[ "$DRY" = 1 ] && echo "gpu_check plan (dry run${BUDGET:+, budget ${BUDGET}s}): step, timeout, command"

declare -a SUMMARY=()
FAILED=0
# The seconds step NAME may take: its CAP, or less when the budget has less left (0: not worth starting).
limit_for() {
  local cap=$1 now=$SECONDS
  [ "$DRY" = 1 ] && now=$DRY_CLOCK
  if [ -z "$BUDGET" ]; then echo "$cap"; return; fi
  local left=$(( BUDGET - now - 15 ))
  if [ $left -lt 30 ]; then echo 0; elif [ $left -lt "$cap" ]; then echo "$left"; else echo "$cap"; fi
}

# step NAME CAP_S USUAL_S CMD...: runs CMD with a time limit (limit_for), logs to logs/NAME.log, rewrites the
# report. USUAL_S is what the step usually takes on an H100 machine: the dry run's clock.
step() {
  local name=$1 limit
  limit=$(limit_for "$2")
  local usual=$3
  shift 3
  if [ "$DRY" = 1 ]; then
    local cmd="$*"
    cmd=${cmd//$'\n'/ }
    if [ "$limit" -eq 0 ]; then echo "  $name: not started (budget spent)"; else echo "  $name: ${limit}s: ${cmd:0:240}"; fi
    DRY_CLOCK=$(( DRY_CLOCK + (usual < limit ? usual : limit) ))
    return 0
  fi
  if [[ $SKIP == *" $name "* ]]; then
    SUMMARY+=("| $name | skipped (GPU_CHECK_SKIP) | - | - |")
    FAILED=1
    return 0
  fi
  if [ "$limit" -eq 0 ]; then
    SUMMARY+=("| $name | not started (budget of ${BUDGET}s spent) | - | - |")
    FAILED=1
    write_report
    return 1
  fi
  echo "== $name (up to ${limit}s): $*"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) status=pass
  if [ $rc -ne 0 ]; then
    status="FAIL (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit}s"))"
    FAILED=1
  fi
  echo "   $status in ${took}s"
  tail -n 3 "$LOGS/$name.log" | sed 's/^/   | /'
  SUMMARY+=("| $name | $status | ${took}s | \`logs/$name.log\` |")
  write_report
  return $rc
}

# pytest's closing line ("12 passed, 1 skipped in 3.4s") of a log.
verdict() { grep -E '(passed|failed|error).* in [0-9.]+s' "$1" 2>/dev/null | tail -n 1 | tr -d '=' | sed 's/^ *//'; }

# section TITLE TABLE STEP: a report section showing the Markdown table a step wrote (or where its log is)
section() {
  printf '## %s\n\n' "$1"
  cat "$OUT_DIR/$2" 2>/dev/null || echo "(no table: see logs/$3.log)"
  echo
}

# -- report (rewritten after every step) ----------------------------------------------------
write_report() {
  {
    echo "# GPU check"
    echo
    echo "\`tools/gpu_check.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'), commit ${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}."
    echo
    echo '```'
    cat "$LOGS/versions.log" 2>/dev/null
    echo '```'
    echo
    echo "| step | result | time | log |"
    echo "|---|---|---|---|"
    printf '%s\n' "${SUMMARY[@]}"
    echo
    echo "## Tests"
    echo
    echo "- \`pytest -m cuda\` (single process): $(verdict "$LOGS/pytest_cuda.log")"
    echo "- multi-process on cuda:0 over NCCL: $(verdict "$LOGS/pytest_multiprocess_cuda.log")"
    echo "- whole suite: $(verdict "$LOGS/pytest_all.log")"
    grep -E '(FAILED|ERROR) tests/' "$LOGS/pytest_all.log" "$LOGS/pytest_cuda.log" "$LOGS/pytest_multiprocess_cuda.log" 2>/dev/null | sed 's/^/  - /' | head -n 20
    for tool in memcheck racecheck; do
      [ -f "$LOGS/sanitizer_$tool.log" ] &&
        echo "- compute-sanitizer $tool: $(grep -E '(ERROR|RACECHECK) SUMMARY' "$LOGS/sanitizer_$tool.log" | tail -n 1 | sed 's/^=* *//') over $(verdict "$LOGS/sanitizer_$tool.log")"
    done
    echo
    echo "## Multi-process pipelines on cuda:0 against the unsplit model"
    echo
    cat "$OUT_DIR/multiprocess.md" 2>/dev/null || echo "(no table: see logs/pytest_multiprocess_cuda.log)"
    echo
    echo "## Pipe on cuda:0 against the unsplit model"
    echo
    echo "Every schedule, checkpoint mode and precision (tests/comm/test_cuda_paths.py; loss and every gradient within"
    echo "rtol/atol 1e-4/1e-5 for fp32 and 3e-2/3e-3 under autocast bf16):"
    echo
    cat "$OUT_DIR/equivalence.md" 2>/dev/null || echo "(no table yet)"
    echo
    section "Kernels (benchmarks/bench_kernels.py)" kernels.md bench_kernels
    section "Copy/compute overlap (benchmarks/bench_overlap.py)" overlap.md bench_overlap
    echo "## CUDA IPC transport (tests/comm/test_ipc_gpu.py, benchmarks/bench_transport.py --device cuda)"
    echo
    echo "- suites under transport=\"ipc\" on cuda:0: $(verdict "$LOGS/ipc_suites.log")"
    grep -E '(FAILED|ERROR) tests/' "$LOGS/ipc_suites.log" 2>/dev/null | sed 's/^/  - /' | head -n 20
    echo
    echo '```'
    grep -E '^(ping-pong| *message| *[0-9]+ (B|KB|MB) )' "$LOGS/bench_transport_cuda.log" 2>/dev/null || echo "(no table: see logs/bench_transport_cuda.log)"
    echo '```'
    echo
    echo "## 2-rank 1F1B over NCCL, pipeline_ext vs torch (benchmarks/bench_pipeline.py --device cuda)"
    echo
    echo '```'
    tail -n 8 "$LOGS/bench_pipeline_nccl.log" 2>/dev/null || echo "(not run)"
    echo '```'
    echo
    echo "## NCCL ordering model and steady-state steps on cuda:0"
    echo
    echo "- tests/schedules/test_nccl_order.py, and torch PR 195760's looped schedule on 4 NCCL ranks: $(verdict "$LOGS/nccl_order.log")"
    echo "- steady-state steps (no host synchronisation under set_sync_debug_mode(\"error\"), same messages every step): $(verdict "$LOGS/steady_state_cuda.log")"
    grep -E '(FAILED|ERROR) tests/' "$LOGS/nccl_order.log" "$LOGS/steady_state_cuda.log" 2>/dev/null | sed 's/^/  - /' | head -n 20
    echo
    echo "## Pipeline x tensor parallel on cuda:0 (pp=2 x tp=1, tests/parallel/test_tensor_parallel.py -m cuda)"
    echo
    echo "- $(verdict "$LOGS/pytest_tp_cuda.log")"
    grep -E '::.* (PASSED|FAILED|ERROR|SKIPPED)' "$LOGS/pytest_tp_cuda.log" 2>/dev/null | sed 's/^/  - /' | head -n 10
    echo
    echo "## Zero bubble on cuda:0 (benchmarks/bench_zb_sac.py --device cuda)"
    echo
    echo '```'
    grep -E '^(gain over|select|== |[0-9]+ transformer)' "$LOGS/bench_zb_cuda.log" 2>/dev/null || echo "(not run)"
    echo '```'
    echo
    section "Host-device synchronisations in a known multi-process step (tools/gpu_sync_count.py --ranks 2)" \
      syncs_multiprocess.md sync_count_multiprocess
    section "Host-device synchronisations in one Pipe.step (tools/gpu_sync_count.py)" syncs.md sync_count
    echo "## Long context on two CPU cores of their own (benchmarks/bench_long_context.py --ranks 2)"
    echo
    echo '```'
    grep -E '^(2 Gloo|long context|  [0-9]+ chunks|  where)' "$LOGS/long_context_cpu.log" 2>/dev/null || echo "(not run, or still running)"
    echo '```'
  } >"$REPORT"
}


# 1. build
# torch's extension build compiles and links with $CXX. Some GPU images point
# it at a toolchain that links libstdc++ statically (seen: /opt/gcc/bin/g++):
# the extension then carries a second C++ runtime beside torch's and segfaults
# on its first formatted error message. The system compiler links it shared.
export CXX=${GPU_CHECK_CXX:-c++} CC=${GPU_CHECK_CC:-cc}

# pip may refuse (an old pip, a setuptools that re-enters pip with isolation):
# then an in-place build against the same torch, found through PYTHONPATH.
# Its usual 80 s: the build on an H200 with 16 jobs (CONTRIBUTING.md).
if ! step build 900 80 env MAX_JOBS="$(nproc)" "$PY" -m pip install --no-deps --no-build-isolation -e .; then
  step build_inplace 900 90 env MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace || {
    printf '# GPU check\n\nThe build failed; see `logs/build.log` and `logs/build_inplace.log`.\n' >"$REPORT"
    tail -n 40 "$LOGS/build_inplace.log"
    exit 1
  }
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
step versions 120 10 "$PY" -c '
import torch, pipeline_ext
from pipeline_ext.runtime._ext import _C
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
print(f"device {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
print(f"pipeline_ext._C built with CUDA: {_C.with_cuda}")
assert _C.with_cuda, "the extension was built without CUDA"
import subprocess
assert "libstdc++.so" in subprocess.run(["ldd", _C.__file__], capture_output=True, text=True).stdout, \
    "_C links libstdc++ statically: a second C++ runtime beside the one torch uses"
'
if [ "$DRY" != 1 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$LOGS/versions.log" 2>&1
  nvcc --version | tail -n 2 >>"$LOGS/versions.log" 2>&1
  write_report
fi

# 1c (beside the rest). Long context on two CPU cores of their own: bench_long_context's speed criterion needs
# cores whose speed does not wander (each rank alone on its core, a bubble idle time); a GPU machine's spare
# cores are quieter than a 2-core VM. The rest of the run is moved off those two cores.
BG_PID="" BG_NAME=long_context_cpu
read -r BG_CORES REST_CORES < <("$PY" -c 'import os; c = sorted(os.sched_getaffinity(0))
print(",".join(map(str, c[-2:])), ",".join(map(str, c[:-2])) if len(c) >= 8 else "")')
if [ -n "${REST_CORES:-}" ] && [[ $SKIP != *" $BG_NAME "* ]]; then
  bg_limit=$(limit_for 600)
  bg_cmd=(env PYTHONPATH=".:tests${PYTHONPATH:+:$PYTHONPATH}" taskset -c "$BG_CORES" "$PY" benchmarks/bench_long_context.py --ranks 2 --repeats 8)
  if [ "$DRY" = 1 ]; then
    echo "  $BG_NAME (beside the steps below, cores $BG_CORES): ${bg_limit}s: ${bg_cmd[*]}"
  elif [ "$bg_limit" -gt 0 ]; then
    taskset -pc "$REST_CORES" $$ >/dev/null
    echo "== $BG_NAME (beside the rest, cores $BG_CORES, up to ${bg_limit}s): ${bg_cmd[*]}"
    BG_T0=$SECONDS
    timeout --kill-after=10 "$bg_limit" "${bg_cmd[@]}" >"$LOGS/$BG_NAME.log" 2>&1 &
    BG_PID=$!
  fi
fi

# 1b. NCCL itself between two ranks sharing cuda:0: where it stops, if it does
step nccl_probe 120 10 "$PY" tools/nccl_probe.py --timeout 25 "$LOGS/nccl_probe"

# 2. multi-process pipelines on the GPU: the multi-process equivalence, agreement and PP x DP tests,
# parametrised by device (tests/conftest.py: rank_device, stage_device), every rank's stages on cuda:0,
# the default group Gloo + NCCL, each rank an NCCL host of its own (NCCL_HOSTID, comm.launch.spawn), the
# reference model on the same GPU.
MP_TESTS=(tests/stages/test_distributed.py tests/comm/test_step_agreement.py tests/parallel/test_data_parallel.py)
# under a budget the two test steps get at most 2/5 and 1/4 of it, so the benchmarks after them get a turn;
# a test that hangs is stopped after 120 s (the next one gets a turn), every pool rank still in its task after
# 60 s prints its threads' stacks (-s: into the step's log)
export PIPELINE_EXT_TEST_STACKS_AFTER=${PIPELINE_EXT_TEST_STACKS_AFTER:-60}
share() { if [ -n "$BUDGET" ]; then echo $(( BUDGET * $1 / $2 )); else echo 900; fi; }
step pytest_multiprocess_cuda "${GPU_CHECK_MP_LIMIT:-$(share 2 5)}" 150 "$PY" -m pytest -m "cuda and slow" -v -s --timeout 120 -p no:cacheprovider \
  --junitxml="$LOGS/multiprocess_cuda.xml" "${MP_TESTS[@]}"
if [ -f "$LOGS/multiprocess_cuda.xml" ]; then
  "$PY" - "$LOGS/multiprocess_cuda.xml" >"$OUT_DIR/multiprocess.md" 2>>"$LOGS/multiprocess_table.log" <<'EOF'
import sys, xml.etree.ElementTree as ET
print("| test (stages on cuda:0, NCCL) | result | time |")
print("|---|---|---|")
for case in ET.parse(sys.argv[1]).iter("testcase"):
    bad = case.find("failure") is not None or case.find("error") is not None
    result = "FAIL" if bad else "skip" if case.find("skipped") is not None else "pass"
    print(f"| {case.get('name')} | {result} | {float(case.get('time', 0)):.0f} s |")
EOF
  write_report
fi

# 2b. pipeline x tensor parallel: pp=2 x tp=1 on cuda:0, DTensor activations between stages over NCCL
step pytest_tp_cuda "$(share 1 5)" 60 "$PY" -m pytest -m cuda -v -s --timeout 120 -p no:cacheprovider tests/parallel/test_tensor_parallel.py

# 2c. the NCCL ordering model: its CPU tests, then its verdict on PR 195760's schedule against NCCL itself
step nccl_order 180 25 "$PY" -m pytest -v -s --timeout 120 -p no:cacheprovider tests/schedules/test_nccl_order.py \
  "tests/runtime/test_steady_state.py::test_the_ordering_models_hang_case_trains_under_the_runtimes_choices[cuda-nccl]"

# 2d. steady-state steps on cuda:0 over NCCL: no host synchronisation, the same messages every step
step steady_state_cuda 180 30 "$PY" -m pytest -m cuda -k steady_step -v -s --timeout 120 -p no:cacheprovider \
  tests/runtime/test_steady_state.py

# 3. single-process CUDA tests (the multi-process ones ran in step 2); -v: a run cut short by the budget still
# names each result it got to
step pytest_cuda 900 150 "$PY" -m pytest -m "cuda and not slow" -v -p no:cacheprovider --junitxml="$LOGS/cuda.xml"

# Pipe equivalence table (the tests ran in step 3; this lists them one by one)
if [ -f "$LOGS/cuda.xml" ]; then
  "$PY" - "$LOGS/cuda.xml" >"$OUT_DIR/equivalence.md" 2>>"$LOGS/equivalence.log" <<'EOF'
import re, sys, xml.etree.ElementTree as ET
rows = {}
for case in ET.parse(sys.argv[1]).iter("testcase"):
    m = re.match(r"test_pipe_on_one_gpu_matches_unsplit\[(\w+)-(always|except_last|never)-(fp32|bf16)\]",
                 case.get("name", ""))
    if not m:
        continue
    name, checkpoint, precision = m.groups()
    bad = case.find("failure") is not None or case.find("error") is not None
    skipped = case.find("skipped") is not None
    rows.setdefault(name, {})[(checkpoint, precision)] = "FAIL" if bad else "skip" if skipped else "ok"
cols = [(c, p) for c in ("always", "except_last", "never") for p in ("fp32", "bf16")]
print("| schedule | " + " | ".join(f"{c} {p}" for c, p in cols) + " |")
print("|---|" + "---|" * len(cols))
for name, cells in rows.items():
    print(f"| {name} | " + " | ".join(cells.get(k, "-") for k in cols) + " |")
EOF
  write_report
fi

# 4. the CUDA IPC transport: its multi-process suites on cuda:0
step ipc_suites "$(share 1 4)" 90 "$PY" -m pytest tests/comm/test_ipc_gpu.py tests/comm/test_ipc_transport.py -v -s --timeout 60 -p no:cacheprovider \
  --junitxml="$LOGS/ipc_suites.xml"

# 5. 2-rank 1F1B, ours vs torch over NCCL, in the same processes
pipeline_args=(--device cuda --schedules 1f1b --dims 4096 --repeats 3 --steps 3)
[ "$QUICK" = 1 ] && pipeline_args=(--device cuda --schedules 1f1b --dims 1024 --repeats 2 --steps 2)
step bench_pipeline_nccl 600 60 "$PY" benchmarks/bench_pipeline.py "${pipeline_args[@]}"

# 5b. the zero-bubble gain table on the GPU (2 ranks on cuda:0 over NCCL), with SAC and without
zb_args=(--device cuda --ranks 2 --d 1024 --heads 8 --seq 256 --rows 4 --blocks 8 --microbatches 8 --both --repeats 3 --steps 2)
[ "$QUICK" = 1 ] && zb_args=(--device cuda --ranks 2 --d 256 --seq 64 --blocks 4 --microbatches 4 --both --repeats 1 --steps 1)
step bench_zb_cuda 300 60 "$PY" benchmarks/bench_zb_sac.py "${zb_args[@]}"

# 6. IPC vs NCCL round trips
transport_args=(--device cuda)
[ "$QUICK" = 1 ] && transport_args+=(--n 20 --repeats 3)
step bench_transport_cuda 900 60 "$PY" benchmarks/bench_transport.py "${transport_args[@]}"

# 7. synchronisations in a known multi-process step
step sync_count_multiprocess 300 30 "$PY" tools/gpu_sync_count.py --ranks 2 --markdown "$OUT_DIR/syncs_multiprocess.md"

# 8. synchronisations in one Pipe.step
step sync_count 600 45 "$PY" tools/gpu_sync_count.py --markdown "$OUT_DIR/syncs.md"

# 9. kernel and overlap benchmarks
bench_args=(--device cuda --markdown "$OUT_DIR/kernels.md")
[ "$QUICK" = 1 ] && bench_args+=(--quick)
step bench_kernels 900 90 "$PY" benchmarks/bench_kernels.py "${bench_args[@]}"
overlap_args=(--markdown "$OUT_DIR/overlap.md")
[ "$QUICK" = 1 ] && overlap_args+=(--quick)
step bench_overlap 900 45 "$PY" benchmarks/bench_overlap.py "${overlap_args[@]}"

# 10. compute-sanitizer (without the caching allocator, so out-of-bounds accesses
# inside a cached block are seen too)
# racecheck instruments every shared-memory access of torch's own kernels too,
# so it runs a smaller selection of the Pipe cases.
# Every kernel and copy of ours runs under it: ops on CUDA, the copy streams, and
# a few Pipe schedules (each Pipe case runs the same kernels; the tools slow
# torch's own kernels tenfold, so not all 48).
SAN_TESTS=(tests/runtime/test_ops.py tests/comm/test_channels.py tests/comm/test_cuda_paths.py -m cuda -q -p no:cacheprovider -x
           -k "test_ops or test_channels or connected or dist_channel or (split_between and (1f1b or zbv)) or (matches_unsplit and (1f1b-except_last-fp32 or zb_h1-always-fp32 or zbv-never-fp32)) or (dropout and zb_h1)")
if [ "$DRY" = 1 ] || command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    step "sanitizer_$tool" 300 200 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" \
      --error-exitcode 97 --target-processes all "$PY" -m pytest "${SAN_TESTS[@]}"
  done
else
  SUMMARY+=("| sanitizer | FAIL (compute-sanitizer not on PATH) | - | - |")
  FAILED=1
fi

# 11. the whole suite, last: it is mostly the CPU suite (as in CI) and takes
# whatever time is left (of the budget, or before GPU_CHECK_DEADLINE: seconds
# since the start, default 1800). Several workers when pytest-xdist is there:
# the multi-process tests pick free ports. -v prints each result as it comes,
# so a run cut short still names its failures.
xdist=()
"$PY" -c 'import xdist' 2>/dev/null && xdist=(-n "$(( $(nproc) > 8 ? 8 : $(nproc) ))")
if [ -n "$BUDGET" ]; then
  all_cap=$BUDGET
else
  all_cap=$(( ${GPU_CHECK_DEADLINE:-1800} - SECONDS ))
  all_cap=$(( all_cap > 60 ? all_cap : 60 ))
fi
step pytest_all "$all_cap" 600 "$PY" -m pytest -v -p no:cacheprovider --junitxml="$LOGS/all.xml" "${xdist[@]}"

# the long-context benchmark beside the steps: its own timeout ends it within the budget
if [ -n "$BG_PID" ]; then
  wait "$BG_PID"
  rc=$?
  status=pass
  if [ $rc -ne 0 ]; then status="FAIL (exit $rc$([ $rc -eq 124 ] && echo ", timed out"))"; FAILED=1; fi
  SUMMARY+=("| $BG_NAME (beside the rest) | $status | $((SECONDS - BG_T0))s | \`logs/$BG_NAME.log\` |")
fi

if [ "$DRY" = 1 ]; then
  echo "(dry run: nothing was built or run)"
  exit 0
fi
write_report
echo "report: $REPORT"
exit $FAILED
