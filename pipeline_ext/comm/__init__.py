"""Multi-process pipelines: one rank per process, over torch.distributed (or same-host shared memory).

``session.py`` is the centre: a ``Session`` per schedule holds what its steps
share, and ``Session.begin`` returns the ``Step`` the executor runs over (its
module doc walks through one step). Around it, everything said on the wire:

1. **Agreement** (``agreement.py``). Each rank posts one fixed-size record
   (step number, step kind, schedule, microbatches, its own inputs accepted
   or rejected with the reason, batch/target rows per microbatch, every
   microbatch's signature, the digest of its cached layouts) to every other
   rank, under ``AGREEMENT_TAG``. Every rank runs the same pure decision over
   the same records (``agree``): either all start the step knowing every
   microbatch's signature, or all raise, naming the rank and why. Step numbers belong to the process group
   (``identity.GroupSteps``).
2. **Message identity** (``runtime/tags.py``). Every activation and gradient
   message has a tag made of the step number (mod 1024) and
   (microbatch, sending stage, direction).
3. **Layouts** (``comm_plan.py``). A step with a microbatch signature not
   seen before is a discovery step: each message is preceded by its layout (a
   zero-padded int64 message under ``tag | LAYOUT_TAG_BIT``), read by the one
   parser (C++ ``PackLayout::decode``). The layouts of a completed step are
   kept per microbatch signature (an LRU per step kind, held by the session);
   a later step whose microbatches were all seen, in any order, receives into
   buffers preallocated from them. When the ranks' caches differ (the
   agreement compares their digests) every rank rediscovers.

The transport (``transport/``: its pure decisions, the setup over the group,
and the channels, ``DistChannel`` over C++ ``ProcessGroupChannel``,
``AutoChannel`` over shared memory or the group, ``IpcChannel`` over CUDA IPC)
keeps no state in a channel: one message per send, a receive into a buffer of
a given layout; the peers settle together which one a group uses.
``groups.py`` makes the groups (NCCL: one per direction), ``data_parallel.py``
syncs DDP/FSDP2 stages once per step, ``skips.py`` gathers skip declarations,
``trace.py`` gathers traces, ``launch.py`` starts local ranks for the demo,
benchmarks and tests.
"""
