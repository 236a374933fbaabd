"""What ``comm.launch.spawn``'s fork server imports last: the caller's script, run there once, then a freeze.

Why this exists: a rank forked from the server must not run the caller's
script again. multiprocessing means ``set_forkserver_preload(["__main__"])``
to do that, but before Python 3.13.8 it never did: the server looks for the
script's path under a key that ``spawn.get_preparation_data`` stopped writing
in 2013 (CPython gh-126631, gh-137996). So every rank re-ran the script's
imports: a script importing ``transformers`` cost each rank seconds of
imports. ``launch`` hands the path over in :data:`MAIN_ENV` while it starts
the server; here it is run as ``__mp_main__`` exactly as multiprocessing
would run it in the rank, so the rank finds its ``__main__`` in place and
skips the re-run.

If the script raises when run here, nothing is kept and every rank runs it
itself, as before, and reports what it raises where the caller sees it.

Then ``gc.freeze()``: everything imported so far lives as long as the rank,
so a rank's garbage collections need not walk it (with torch imported that
walk is most of a collection).
"""
from __future__ import annotations

import gc
import os
import sys

#: the environment variable that carries the caller's script path to the fork server (set only while it starts)
MAIN_ENV = "PIPELINE_EXT_FORKSERVER_MAIN"


def _run_main(path: str) -> None:
    from multiprocessing import process, spawn

    before = sys.modules.get("__main__")
    process.current_process()._inheriting = True  # as multiprocessing's own preload: the script may not start processes
    try:
        spawn.import_main_path(path)
    except Exception:  # noqa: BLE001 - the rank runs the script itself and reports the error (see the docstring)
        sys.modules["__main__"] = before
        sys.modules.pop("__mp_main__", None)
    finally:
        del process.current_process()._inheriting


_path = os.environ.pop(MAIN_ENV, None)
if _path:
    _run_main(_path)
gc.collect()
gc.freeze()
