"""The runtime: stage runner, channels, executor and tracing.

Everything here consumes lowered schedules from ``pipeline_ext.schedules`` and
is shared by the single-process ``Pipe`` and the multi-process API.
"""
