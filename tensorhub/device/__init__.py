"""Device buffers (CUDA tensors and arrays) as sources and targets of TensorHub.

- :mod:`.buffers` -- what a tensor is in memory: an address, a size, a dtype, a shape,
  on the host or on a GPU, read from torch, ``__cuda_array_interface__`` or DLPack.
- :mod:`.copier` -- the copies between ring slots and tensors: ``memmove`` on the host,
  ``cudaMemcpyAsync`` on a CUDA stream per thread on a GPU.
- :mod:`.ring` -- the staging ring: a fixed set of host slots (pinned on a GPU) that
  chunks pass through, with flow control and per-slot tickets.
- :mod:`.landing` -- a fetch into device memory: each chunk lands in a slot, is checked
  there and copied to its place (into host tensors block by block as it is hashed).
- :mod:`.serving` -- a held device version served over the network: chunks are copied
  to slots ahead of the reader.
"""
