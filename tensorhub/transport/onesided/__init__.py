"""The one-sided transports: a reader reads the holder's registered memory itself
(RDMA READ over an RC queue pair, CUDA IPC), the data connection carrying control only.

- :mod:`.backend` -- the seam every backend implements (register, grant and revoke
  remote access, links, posted reads and their completions) and the reading loop.
- :mod:`.registry` -- registered memory by buffer: once per buffer, reused across
  versions, keys revoked on unpublish.
- :mod:`.holder` / :mod:`.reader` -- the protocol's two sides
  (:mod:`tensorhub.protocol.onesided` has the messages).
- :mod:`.standin` -- in-process stand-ins over host memory (``rdma-standin``,
  ``cuda-ipc-standin``) that run everything above on every machine.

The real backends, imported only when asked for: :mod:`tensorhub.transport.rdma`
(pyverbs) and :mod:`tensorhub.transport.cuda_ipc` (cupy).
"""
