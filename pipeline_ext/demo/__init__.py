"""The demo: ``python -m pipeline_ext.demo`` trains a small GPT on a pipeline of local processes.

``cli.py`` is the command (its own worker processes, progress, bubble, timeline);
``model.py`` is the model it trains, which the benchmarks and tests reuse.
"""
