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
