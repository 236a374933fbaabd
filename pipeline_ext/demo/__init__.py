"""The demo: ``python -m pipeline_ext.demo`` trains a small GPT on a pipeline of local processes.

``cli.py`` is the command (its own worker processes, progress, bubble, timeline);
``model.py`` is the model it trains, which the benchmarks and tests reuse.
``main`` and ``train`` are reachable here, where they were when the demo was one module.
"""
from pipeline_ext._lazy import lazy_names

__all__ = ["main", "train"]
__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "pipeline_ext.demo.cli"), __all__)
