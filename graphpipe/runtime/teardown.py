"""Leaving ``torch.distributed`` so that a rank that trained to the end also exits cleanly.

Under gloo every process group owns worker threads (``pt_gloo_runloop``)
that run its collectives. A collective's work object is often freed on its
worker thread, after the Python caller has moved on; if it holds a tensor
created in Python, freeing it takes the GIL. Should the group still be
alive when the interpreter finalises, that thread is refused the GIL and
unwound inside a destructor that may not throw: the rank aborts with
"terminate called without an active exception" (SIGABRT) after a run that
succeeded, and torchrun reports the job as failed; rarely, and more often
on a loaded host.

So no group may outlive the end of training: each must be freed, its
threads joined, before the rank returns. Two holders used to keep groups
alive beyond ``destroy_process_group``:

* graphpipe's own objects (an executor's replica, tie and link groups, its
  mailbox, synchronised BatchNorms, the step checkpoints' writer group):
  ``RankExecutor.release_groups`` and ``StepCheckpoints`` drop them at
  ``Pipeline.close()`` and at the end of ``graphpipe run``;
* ``torch.distributed.nn.functional``, whose functions take ``group.WORLD``
  as a default argument, evaluated when the module is imported. torch.export
  imports it (through dynamo) the first time a model is captured, usually
  after the group is up, and the world group then lives as long as the
  interpreter. :func:`before_init` imports it while no group exists, so the
  default is ``None``.
"""

from __future__ import annotations

import gc
import os

__all__ = ["before_init", "collect_groups", "gloo_threads"]


def before_init() -> None:
    """Import what would otherwise capture the world group for good; call before ``init_process_group``."""
    import torch.distributed.nn.functional  # noqa: F401  (binds group.WORLD, still None now, as a default)


def collect_groups() -> None:
    """Free process groups only reachable through reference cycles now, not at interpreter exit."""
    gc.collect()


def gloo_threads() -> int:
    """How many gloo worker threads (``pt_gloo_runloop``) this process runs: one group alive keeps them.

    Linux only (reads ``/proc/self/task``); 0 elsewhere.
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended while we looked
            continue
    return count
