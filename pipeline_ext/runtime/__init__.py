"""One rank's engine: stage runners, the executor, in-process channels, kernels, traces.

Nothing here knows about processes: the executor runs one rank's actions of a
lowered schedule (``pipeline_ext.schedules``) over whatever ``StepChannel`` it
is handed (``runtime/channel.py``): ``local.LocalStep`` between the threads of
one process (the ``pipe`` front end), or ``dist.session.Step`` between
processes (the ``pipelining`` front end).
"""
