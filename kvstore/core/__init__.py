"""Pure logic both sides share: hashing, chunk codec, slot allocator, eviction order.

Nothing here does I/O. Submodules are imported explicitly (``kvstore.core.hashing``) so
that torch-free users such as ``kvctl`` never pay for torch.
"""
