"""The step protocol between pipeline ranks: everything that is said on the wire besides the data.

One step of a multi-process schedule, on every rank, in this order:

1. **Agreement** (``agreement.py``). Each rank posts one fixed-size record
   (step number, plan, schedule, microbatches, its own inputs accepted or
   rejected with the reason, batch/target rows, the digest of its plan cache)
   to every other rank, under ``AGREEMENT_TAG``. Every rank runs the same pure
   decision over the same records (``agree``): either all start the step with
   the same signature, sizes and plan, or all raise, naming the rank and why.
   The records are waited on right before the step's first message, so they
   travel while the step's leading compute runs.
2. **Message identity** (``identity.py``). Every activation and gradient
   message has a tag made of the step number (mod 1024) and
   (microbatch, sending stage, direction): a message of another step can never
   be consumed as this step's.
3. **Layouts** (``plan.py``). The first step of a step signature on an
   executor is a discovery step: each message is preceded by its layout (a
   zero-padded int64 message under ``tag | LAYOUT_TAG_BIT``), read by the one
   parser (C++ ``PackLayout::decode``). The layouts of a completed step form the
   signature's communication plan, owned by the executor (LRU of
   ``DEFAULT_MAX_PLANS``); later steps receive into buffers preallocated from
   it. When the ranks' plan caches differ (the agreement compares their
   digests) every rank rediscovers.

The channel (``runtime/channels.DistChannel`` over C++ ``ProcessGroupChannel``)
keeps no state: it sends one message per call and receives into a buffer of a
given layout. docs/ARCHITECTURE.md, "Step protocol", says the same with the
checks each rank makes.

The submodules are imported by name (``protocol.agreement``, ``protocol.plan``,
``protocol.identity``); this package imports nothing itself, so the channel
module can use ``identity`` without an import cycle.
"""
