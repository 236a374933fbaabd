"""Skip connections, torchgpipe's API: ``@skippable``, ``stash``, ``pop``, ``Namespace``, ``verify_skippables``.

``skippable.py`` is what users write; ``tracker.py`` holds a skip between its
stash and its pop within one forward. Where each skip travels between stages
is the runtime's business (``runtime/skips.py``, and ``comm/skips.py``
between processes).
"""
from pipeline_ext.skip.namespace import Namespace
from pipeline_ext.skip.skippable import Skippable, SkipRouteError, pop, skippable, stash, verify_skippables
from pipeline_ext.skip.tracker import SkipKey, SkipTracker, current_skip_tracker, use_skip_tracker

__all__ = ["Namespace", "Skippable", "skippable", "stash", "pop", "verify_skippables", "SkipKey", "SkipTracker",
           "current_skip_tracker", "use_skip_tracker", "SkipRouteError"]
