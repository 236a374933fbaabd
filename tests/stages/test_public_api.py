"""The public surface: about 25 names a training script needs, the rest in subpackages, one table per package.

Every table of names is checked against the modules it reads from: each name
at the top is the very object its home module defines, every name a
subpackage's ``__all__`` lists exists, and a package whose table is read from
its modules' ``__all__`` (``_lazy.exports``) lists exactly those.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

import pipeline_ext as pe

#: every subpackage, and the packages whose tables are read from their modules' ``__all__``
SUBPACKAGES = ["schedules", "skip", "runtime", "comm", "pipelining", "pipe", "training", "demo"]
DERIVED = {"pipeline_ext.pipelining": ["stage", "schedules", "microbatch", "model_split", "mesh"],
           "pipeline_ext.training": ["tied", "clip", "checkpoint", "loss", "profiling"]}


def _defining_module(package: str, name: str) -> str:
    """The module a package's lazy table reads ``name`` from (the package itself when it has no table)."""
    return getattr(importlib.import_module(package), "_EXPORTS", {}).get(name, package)


def test_the_top_level_lists_the_names_a_training_script_needs():
    names = [n for n in pe.__all__ if n not in pe._SUBMODULES]
    assert len(names) <= 26, names
    assert not [n for n in names if n.startswith("_")]
    for n in ("PipelineStage", "Schedule1F1B", "ScheduleVHalf", "ScheduleVMin", "Pipe", "ChannelError",
              "ChannelTimeout", "StepRejectedError"):
        assert n in names
    assert sorted(dir(pe)) == sorted(pe.__all__)
    assert len(pe.__all__) == len(set(pe.__all__))


def test_every_top_level_name_is_the_object_its_home_module_defines():
    for home, names in pe._PUBLIC.items():
        package = importlib.import_module(home)
        for name in names:
            assert name in package.__all__, f"{name} is not in {home}.__all__"
            defining = importlib.import_module(_defining_module(home, name))
            assert name in defining.__all__, f"{name} is not in {defining.__name__}.__all__"
            assert getattr(pe, name) is getattr(package, name) is getattr(defining, name), name


def test_every_name_of_a_reachable_subpackage_resolves_at_the_top_to_the_same_object():
    public = {n for names in pe._PUBLIC.values() for n in names}
    first: dict[str, str] = {}
    for home in pe._REACHABLE:
        package = importlib.import_module(home)
        for name in package.__all__:
            if name in getattr(package, "_SUBMODULES", {}):
                continue  # a module of the subpackage (pipelining.schedules): pe.schedules is another one
            if name in first and name not in public:  # listed twice: both must be one object
                assert getattr(package, name) is getattr(importlib.import_module(first[name]), name), (
                    f"{name}: {home} and {first[name]} list different objects")
            first.setdefault(name, home)
    for name, home in first.items():
        if name not in public:
            assert getattr(pe, name) is getattr(importlib.import_module(home), name), name
    assert pe.tie_parameters is pe.training.tie_parameters
    assert pe.split_backend is pe.runtime.split_backend
    assert pe.pipeline_mesh is pe.pipelining.pipeline_mesh
    assert pe.balance_by_time is pe.pipe.balance_by_time
    assert pe._ScheduleForwardOnly is pe.pipelining.schedules._ScheduleForwardOnly
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        pe.nope  # noqa: B018


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_every_name_a_subpackage_lists_exists(sub):
    package = importlib.import_module(f"pipeline_ext.{sub}")
    listed = getattr(package, "__all__", [])
    missing = [n for n in listed if not hasattr(package, n)]
    assert not missing, f"pipeline_ext.{sub}.__all__ lists {missing}, which do not resolve"
    assert len(listed) == len(set(listed)), sub


@pytest.mark.parametrize("package", sorted(DERIVED))
def test_a_derived_table_is_its_modules_all(package):
    pkg = importlib.import_module(package)
    want = {}
    for module in DERIVED[package]:
        mod = importlib.import_module(f"{package}.{module}")
        for name in mod.__all__:
            assert hasattr(mod, name), f"{mod.__name__}.__all__ lists {name}, which it lacks"
            want[name] = mod.__name__
    assert pkg._EXPORTS == want
    for name, module in want.items():
        assert getattr(pkg, name) is getattr(importlib.import_module(module), name), name


def test_a_table_refuses_a_module_without_a_literal_all(tmp_path, monkeypatch):
    from pipeline_ext._lazy import exports

    (tmp_path / "fake_pkg").mkdir()
    (tmp_path / "fake_pkg" / "__init__.py").write_text("")
    (tmp_path / "fake_pkg" / "a.py").write_text("__all__ = [\n    'x',  # a comment ] with a bracket\n    'y',\n]\n")
    (tmp_path / "fake_pkg" / "b.py").write_text("__all__ = sorted(['z'])\n")
    (tmp_path / "fake_pkg" / "c.py").write_text("__all__ = ('x',)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("fake_pkg")
    assert exports("fake_pkg", ["a"]) == {"x": "fake_pkg.a", "y": "fake_pkg.a"}
    with pytest.raises(ImportError, match="literal list"):
        exports("fake_pkg", ["b"])
    with pytest.raises(ImportError, match="'x' is in the __all__ of both fake_pkg.a and c"):
        exports("fake_pkg", ["a", "c"])
    monkeypatch.delitem(sys.modules, "fake_pkg")


def test_one_timeout_error_for_both_front_ends():
    assert issubclass(pe.ChannelTimeout, TimeoutError) and issubclass(pe.ChannelTimeout, pe.ChannelError)


def test_microbatch_and_ops_are_second_names_of_their_modules_in_a_fresh_interpreter():
    script = textwrap.dedent("""
        import sys
        import pipeline_ext.microbatch
        from pipeline_ext.ops import even_sizes
        import pipeline_ext as pe
        assert sys.modules["pipeline_ext.microbatch"] is sys.modules["pipeline_ext.runtime.microbatch"]
        assert pipeline_ext.microbatch.__spec__.name == "pipeline_ext.runtime.microbatch"
        assert even_sizes is pe.runtime.ops.even_sizes and pe.ops is pe.runtime.ops
        assert pe.microbatch is pe.runtime.microbatch
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("path", ["pipeline_ext.dist", "pipeline_ext.distributed", "pipeline_ext.launch",
                                  "pipeline_ext.schedule_classes", "pipeline_ext.tracer",
                                  "pipeline_ext.pipelining.schedule", "pipeline_ext.pipelining.schedule_classes"])
def test_the_module_paths_of_earlier_releases_are_gone(path):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(path)


def test_the_short_name_of_zbv_is_gone():
    with pytest.raises(AttributeError):
        pe.ScheduleZBV  # noqa: B018  (torch's name is ScheduleZBVZeroBubble)
    assert "ScheduleZBV" not in dir(pe.pipelining.schedules)
