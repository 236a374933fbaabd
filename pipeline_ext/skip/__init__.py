"""Skip connections, torchgpipe's API: ``@skippable``, ``stash``, ``pop``, ``Namespace``, ``verify_skippables``.

``skippable.py`` is what users write; ``tracker.py`` holds a skip between its
stash and its pop within one forward; ``routes.py`` says which stage sends
which skip to which, for ``Pipe`` and for multi-process pipelines alike.
"""
from pipeline_ext.skip.namespace import Namespace
from pipeline_ext.skip.routes import SkipRouteError, SkipRoutes, StageSkips, declared_skips
from pipeline_ext.skip.skippable import Skippable, pop, skippable, stash, verify_skippables
from pipeline_ext.skip.tracker import SkipKey, SkipTracker, current_skip_tracker, use_skip_tracker

__all__ = ["Namespace", "Skippable", "skippable", "stash", "pop", "verify_skippables", "SkipKey", "SkipTracker",
           "current_skip_tracker", "use_skip_tracker", "SkipRoutes", "SkipRouteError", "StageSkips", "declared_skips"]
