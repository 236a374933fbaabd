"""The public surface: about 25 names a training script needs, the rest in subpackages, every old name still there."""
from __future__ import annotations

import pytest

import pipeline_ext as pe


def test_the_top_level_lists_the_names_a_training_script_needs():
    names = [n for n in pe.__all__ if n not in pe._SUBMODULES]
    assert len(names) <= 26, names
    assert not [n for n in names if n.startswith("_")]
    for n in ("PipelineStage", "Schedule1F1B", "Pipe", "ChannelError", "ChannelTimeout", "StepRejectedError"):
        assert n in names
    assert sorted(dir(pe)) == sorted(pe.__all__)


def test_names_moved_to_subpackages_still_resolve_to_the_same_objects():
    assert pe.tie_parameters is pe.training.tie_parameters
    assert pe.TokenMeanLoss is pe.training.TokenMeanLoss
    assert pe.split_backend is pe.runtime.split_backend
    assert pe.activation_bytes is pe.runtime.activation_bytes
    assert pe.pipeline_mesh is pe.pipelining.pipeline_mesh
    assert pe.balance_by_time is pe.pipe.balance_by_time
    for name in set(pe._ELSEWHERE) - {"ScheduleZBV"}:
        assert getattr(pe, name) is not None, name
    with pytest.warns(DeprecationWarning, match="ScheduleZBV is ScheduleZBVZeroBubble"):
        assert pe.ScheduleZBV is pe.ScheduleZBVZeroBubble


def test_one_timeout_error_for_both_front_ends():
    from pipeline_ext.runtime.executor import PipelineTimeoutError

    assert PipelineTimeoutError is pe.ChannelTimeout
    assert issubclass(pe.ChannelTimeout, TimeoutError) and issubclass(pe.ChannelTimeout, pe.ChannelError)


def test_the_old_package_name_dist_still_imports_the_same_objects_and_warns(monkeypatch):
    import importlib
    import sys

    import pytest

    import pipeline_ext.comm.launch
    import pipeline_ext.comm.shm

    # import the alias afresh (an earlier test may have imported it), and put everything back after
    if "dist" in vars(pe):  # (not hasattr: that would import it through the lazy names)
        monkeypatch.delattr(pe, "dist")
    for name in [n for n in sys.modules if n == "pipeline_ext.dist" or n.startswith("pipeline_ext.dist.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.warns(DeprecationWarning, match=r"pipeline_ext\.dist is now pipeline_ext\.comm"):
        import pipeline_ext.dist.launch
    from pipeline_ext.dist.launch import spawn
    from pipeline_ext.dist.shm import make_channel

    assert spawn is pipeline_ext.comm.launch.spawn
    assert make_channel is pipeline_ext.comm.shm.make_channel
    assert pipeline_ext.dist.launch is pipeline_ext.comm.launch
    assert pe.dist is sys.modules["pipeline_ext.dist"]
    for module in pe.dist.__all__:  # every submodule, by both names
        comm_module = importlib.import_module(f"pipeline_ext.comm.{module}")
        assert importlib.import_module(f"pipeline_ext.dist.{module}") is comm_module
        assert getattr(pe.dist, module) is comm_module
    assert {"launch", "shm", "session", "agreement"} <= set(pe.dist.__all__)
    assert "dist" not in pe.__all__ and "comm" in pe.__all__


def test_names_moved_out_of_a_module_still_import_from_it():
    from pipeline_ext.comm import shm, transport

    for name in ("TRANSPORTS", "TRANSPORT_ENV", "UnsettledTransport", "check_request", "decide_transport",
                 "ipc_unavailable", "probe_verdict", "requested_transport"):
        assert getattr(shm, name) is getattr(transport, name), name
        assert name in shm.__all__
    from pipeline_ext.runtime import executor, group_run

    assert executor.GroupRun is group_run.GroupRun and "GroupRun" in executor.__all__
    from pipeline_ext.pipe import pipe, placement

    assert pipe.MULTI_STAGE_SCHEDULES is placement.MULTI_STAGE_SCHEDULES is pe.pipe.MULTI_STAGE_SCHEDULES
    assert pipe.Partition is placement.Partition


#: every module path an earlier release had that moved: new home, and the names it exported (its ``__all__``)
MOVED_PATHS = {
    "pipeline_ext.microbatch": ("pipeline_ext.runtime.microbatch", [
        "TensorChunkSpec", "Replicate", "REPLICATE", "Reduce", "split_args_kwargs", "split_args_kwargs_into_chunks",
        "merge_chunks", "microbatch_sizes", "microbatch_weights", "split_target", "split_step_inputs",
        "split_step_target", "to_device"]),
    "pipeline_ext.ops": ("pipeline_ext.runtime.ops", [
        "split", "concat", "pack", "unpack", "PackLayout", "even_sizes", "PACK_ALIGNMENT"]),
    "pipeline_ext.launch": ("pipeline_ext.comm.launch", ["free_port", "spawn", "RankError"]),
    "pipeline_ext.distributed": ("pipeline_ext.pipelining", [
        "PipelineStage", "PipelineSchedule", "PipeliningMetadataError", "PipeliningShapeError"]),
    "pipeline_ext.schedule_classes": ("pipeline_ext.pipelining.schedule_classes", [
        "PipelineScheduleSingle", "PipelineScheduleMulti", "_PipelineScheduleRuntime", "ScheduleGPipe",
        "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS",
        "ScheduleZBH1", "ScheduleZBH2", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "get_schedule_class"]),
    "pipeline_ext.tracer": ("pipeline_ext.pipelining.model_split", [
        "pipeline", "Pipe", "SplitPoint", "pipe_split", "build_stage", "as_stage"]),
    "pipeline_ext.mesh": ("pipeline_ext.pipelining.mesh", ["pipeline_mesh", "pipeline_layout", "PipelineLayout"]),
    "pipeline_ext.partition": ("pipeline_ext.pipe.partition", [
        "balance_by_params", "balance_by_time", "balance_by_size", "split_min_max"]),
    "pipeline_ext.checkpoint": ("pipeline_ext.pipe.recompute", [
        "CHECKPOINT_MODES", "checkpoint_predicate", "CallRng", "uses_randomness", "is_checkpointing",
        "is_recomputing", "checkpoint_phase"]),
    "pipeline_ext.batchnorm": ("pipeline_ext.pipe.batchnorm", ["DeferredStats"]),
    "pipeline_ext.demo_model": ("pipeline_ext.demo.model", ["GPTConfig", "gpt_stages", "synthetic_batch", "lm_loss"]),
    "pipeline_ext.training.balance": ("pipeline_ext.training.profiling", [
        "profile_layers", "balance_layers", "LayerChain", "stage_modules", "block_ranges", "sizes_with_ends"]),
    "pipeline_ext.demo": ("pipeline_ext.demo", ["main", "train"]),  # a module then, a package now
}

#: imports one old path and reports what it found; run in a forked child of ``_ZYGOTE`` per path
_IMPORT_ONE = """
import importlib, json, sys, warnings
def import_one(old, new, names):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        exec(f"import {old}", {})
        scope = {}
        exec(f"from {old} import " + ", ".join(names), scope)
        module = importlib.import_module(old)
    home = importlib.import_module(new)
    return {"same_module": module is home and sys.modules[old] is home,
            "spec": module.__spec__.name, "same": [n for n in names if scope[n] is getattr(home, n)],
            "warned": [str(w.message) for w in said if issubclass(w.category, DeprecationWarning)
                       and w.filename == "<string>"]}
"""

#: imports torch once (not pipeline_ext), then forks one child per path: each child's interpreter has never
#: imported any of pipeline_ext, as a fresh one, without paying torch's import per path
_ZYGOTE = _IMPORT_ONE + """
import os, traceback
import torch  # noqa: F401
cases = json.loads(sys.argv[1])
results = {}
for old, (new, names) in cases.items():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = json.dumps(import_one(old, new, names))
        except BaseException:
            out = json.dumps({"error": traceback.format_exc()})
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    results[old] = json.loads(b"".join(chunks) or b'{"error": "the child wrote nothing"}')
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def moved_imports():
    """Every old path imported in an interpreter that has never imported pipeline_ext (one forked child each)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _ZYGOTE, json.dumps(MOVED_PATHS)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old", sorted(MOVED_PATHS))
def test_every_module_path_of_an_earlier_release_imports_in_a_fresh_interpreter(old, moved_imports):
    new, names = MOVED_PATHS[old]
    got = moved_imports[old]
    assert "error" not in got, got.get("error")
    assert got["same_module"] and got["spec"] == new, got
    assert got["same"] == names, got
    if old in pe._MOVED_DEPRECATED:  # an old path of an earlier release warns, naming the new one, at the import
        assert got["warned"] and all(f"{old} is now {new}" in w for w in got["warned"]), got
    else:  # the paths torch users write (pipeline_ext.microbatch, .ops) and packages are current names
        assert got["warned"] == [], got


def test_moved_top_level_modules_are_attributes_too():
    for old in pe._MOVED_DEPRECATED:
        name = old.split(".", 1)[1]
        if "." not in name:
            assert name in pe._DEPRECATED and name not in pe.__all__, name
    assert pe.ops is pe.runtime.ops and pe.microbatch is pe.runtime.microbatch


def test_an_old_module_path_that_names_a_package_now_runs_none_of_its_modules_twice():
    import sys
    import warnings

    import pipeline_ext.pipelining.stage

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import pipeline_ext.distributed
    assert pipeline_ext.distributed is sys.modules["pipeline_ext.pipelining"]
    with pytest.raises(ModuleNotFoundError, match="pipeline_ext.distributed.stage"):
        import pipeline_ext.distributed.stage  # noqa: F401
    assert "pipeline_ext.distributed.stage" not in sys.modules
