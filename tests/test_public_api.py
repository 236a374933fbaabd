"""The public surface: about 25 names a training script needs, the rest in subpackages, every old name still there."""
from __future__ import annotations

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
    assert pe.ScheduleZBV is pe.ScheduleZBVZeroBubble
    for name in pe._ELSEWHERE:
        assert getattr(pe, name) is not None, name


def test_one_timeout_error_for_both_front_ends():
    from pipeline_ext.runtime.executor import PipelineTimeoutError

    assert PipelineTimeoutError is pe.ChannelTimeout
    assert issubclass(pe.ChannelTimeout, TimeoutError) and issubclass(pe.ChannelTimeout, pe.ChannelError)
