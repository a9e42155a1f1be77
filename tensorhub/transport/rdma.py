"""RDMA READ with pyverbs: the real backend of the ``rdma`` transport.

pyverbs is rdma-core's Python binding; it comes from the system, not from PyPI (whose
source package does not build against most rdma-core versions)::

    apt-get install rdma-core python3-pyverbs     # Debian, Ubuntu
    dnf install rdma-core python3-pyverbs         # Fedora, RHEL

and is imported only when a peer names ``rdma`` in ``PeerConfig.transports``.  A venv
sees it with ``--system-site-packages``.

What it does, against :class:`~tensorhub.transport.onesided.backend.Backend`:

- one device context, protection domain and completion queue per peer; the device is
  ``$TENSORHUB_RDMA_DEVICE`` (default: the first), port ``$TENSORHUB_RDMA_PORT`` (1), GID
  index ``$TENSORHUB_RDMA_GID_INDEX`` (0; RoCE v2 usually wants the index of its IPv4
  GID, see ``show_gids``);
- one RC queue pair per data connection, set up through that connection
  (``OneSidedHello``/``OneSidedWelcome`` carry QP number, first PSN, LID and GID);
- memory registered once per buffer with ``ibv_reg_mr`` (remote read granted with
  ``ibv_rereg_mr`` changing access where the driver supports it, else by registering
  again: a new rkey either way), host memory or -- GPUDirect RDMA, with the
  ``nvidia-peermem`` module loaded -- device memory of an object exposing
  ``__cuda_array_interface__``; where the NIC cannot register device memory,
  registering it fails with that reason and the caller stages through pinned host
  memory;
- reads posted as signaled ``IBV_WR_RDMA_READ`` work requests, completions polled.

Tested here only through its stand-in (:mod:`.onesided.standin`), which runs the same
protocol; this module has not run against a device in this project's CI (see
``docs/transports.md``).
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import random
import struct
import time
from typing import Any

from ..errors import TransportError
from .onesided.backend import Link, Region
from .onesided.registry import extent

_ENDPOINT = struct.Struct("<IIH16s")  # QP number, first PSN, LID, GID
_KEY = struct.Struct("<I")


def _verbs() -> dict[str, Any]:
    names = ("device", "pd", "cq", "qp", "mr", "addr", "wr", "enums")
    return {n: importlib.import_module(f"pyverbs.{n}") for n in names}


def probe() -> tuple[Any, str]:
    """``(factory, what was found)``, or ``(None, why not)``."""
    try:
        v = _verbs()
    except ImportError:
        return None, ("pyverbs not installed (apt-get install rdma-core python3-pyverbs; "
                      "a venv needs --system-site-packages)")
    try:
        devices = v["device"].get_device_list()
    except Exception as exc:  # pyverbs raises its own errors for a missing kernel side
        return None, f"no RDMA device: {exc}"
    if not devices:
        return None, "no RDMA device (pyverbs found none)"
    wanted = os.environ.get("TENSORHUB_RDMA_DEVICE")
    names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
    name = wanted or names[0]
    if name not in names:
        return None, f"no RDMA device {name!r} (found {', '.join(names)})"
    return (lambda: RdmaBackend(name)), f"RDMA device {name}"


class RdmaBackend:
    """See the module docstring."""

    name = "rdma"
    same_host = False
    depth = 16
    device_memory = False

    def __init__(self, device: str) -> None:
        self._v = v = _verbs()
        self._e = v["enums"]
        self.port = int(os.environ.get("TENSORHUB_RDMA_PORT", "1"))
        self.gid_index = int(os.environ.get("TENSORHUB_RDMA_GID_INDEX", "0"))
        self.ctx = v["device"].Context(name=device)
        self.pd = v["pd"].PD(self.ctx)
        self.lid = int(self.ctx.query_port(self.port).lid)
        self.gid = ipaddress.IPv6Address(self.ctx.query_gid(self.port, self.gid_index).gid
                                         ).packed
        self.rd_atomic = max(1, min(16, int(self.ctx.query_device().max_qp_rd_atom)))
        """RDMA READs in flight per queue pair, as both ends allow (the device's cap)."""

    # -- memory ---------------------------------------------------------------------------

    def _mr(self, addr: int, length: int, remote: bool) -> Any:
        e = self._e
        access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_READ if remote else 0)
        try:
            return self._v["mr"].MR(self.pd, length, access, address=addr)
        except Exception as exc:
            raise TransportError(f"rdma: cannot register {length} bytes at {addr:#x}: "
                                 f"{exc} (device memory needs GPUDirect: nvidia-peermem; "
                                 "else stage through pinned host memory)") from None

    def register(self, memory: Any) -> Region:
        addr, length = extent(memory)
        return Region(addr, length, self._mr(addr, length, remote=False))

    def deregister(self, region: Region) -> None:
        region.handle.close()
        region.key = b""

    def _reaccess(self, region: Region, remote: bool) -> None:
        e = self._e
        access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_READ if remote else 0)
        try:
            region.handle.rereg(e.IBV_REREG_MR_CHANGE_ACCESS, None, 0, 0, access)
        except Exception:  # not supported by this driver (or this pyverbs): register anew
            region.handle.close()
            region.handle = self._mr(region.addr, region.length, remote)

    def grant(self, region: Region) -> None:
        self._reaccess(region, remote=True)
        region.key = _KEY.pack(region.handle.rkey)

    def revoke(self, region: Region) -> None:
        if region.key:
            self._reaccess(region, remote=False)
            region.key = b""

    # -- links ----------------------------------------------------------------------------

    def _qp(self) -> tuple[Any, Any, int]:
        v, e = self._v, self._e
        cq = v["cq"].CQ(self.ctx, 4 * self.depth)
        cap = v["qp"].QPCap(max_send_wr=self.depth, max_recv_wr=1, max_send_sge=1,
                            max_recv_sge=1)
        init = v["qp"].QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap,
                                  sq_sig_all=1)
        return v["qp"].QP(self.pd, init), cq, random.randrange(1 << 24)

    def _endpoint(self, qp: Any, psn: int) -> bytes:
        return _ENDPOINT.pack(qp.qp_num, psn, self.lid, self.gid)

    def _connect(self, qp: Any, psn: int, remote: bytes) -> None:
        v, e = self._v, self._e
        if len(remote) != _ENDPOINT.size:
            raise ValueError("malformed RDMA endpoint")
        qpn, rpsn, lid, gid = _ENDPOINT.unpack(remote)
        gr = v["addr"].GlobalRoute(dgid=v["addr"].GID(str(ipaddress.IPv6Address(gid))),
                                   sgid_index=self.gid_index)
        attr = v["qp"].QPAttr(port_num=self.port)
        attr.ah_attr = v["addr"].AHAttr(gr=gr, is_global=1, dlid=lid, port_num=self.port)
        attr.dest_qp_num = qpn
        attr.rq_psn = rpsn
        attr.sq_psn = psn
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_rd_atomic = attr.max_dest_rd_atomic = self.rd_atomic
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        qp.to_rts(attr)

    def dial(self) -> _Dialing:
        qp, cq, psn = self._qp()
        return _Dialing(self, qp, cq, psn)

    def accept(self, endpoint: bytes) -> tuple[Link, bytes]:
        qp, cq, psn = self._qp()
        try:
            self._connect(qp, psn, endpoint)
        except Exception:
            qp.close()
            cq.close()
            raise
        return _QpLink(self, qp, cq), self._endpoint(qp, psn)


class _Dialing:
    def __init__(self, backend: RdmaBackend, qp: Any, cq: Any, psn: int) -> None:
        self.backend, self.qp, self.cq = backend, qp, cq
        self.psn = psn
        self.endpoint = backend._endpoint(qp, psn)

    def connect(self, holder_endpoint: bytes) -> Link:
        try:
            self.backend._connect(self.qp, self.psn, holder_endpoint)
        except Exception as exc:
            raise TransportError(f"rdma: queue pair setup failed: {exc}") from None
        return _QpLink(self.backend, self.qp, self.cq)

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


class _QpLink:
    def __init__(self, backend: RdmaBackend, qp: Any, cq: Any) -> None:
        self.backend, self.qp, self.cq = backend, qp, cq

    def post_read(self, wr_id: int, local: Region, local_addr: int, remote_addr: int,
                  key: bytes, length: int) -> None:
        v, e = self.backend._v, self.backend._e
        if len(key) != _KEY.size:
            raise TransportError("rdma: a granted key is not an rkey")
        sge = v["wr"].SGE(local_addr, length, local.handle.lkey)
        wr = v["wr"].SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge],
                            send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(_KEY.unpack(key)[0], remote_addr)
        try:
            self.qp.post_send(wr)
        except Exception as exc:
            raise TransportError(f"rdma: post_send failed: {exc}") from None

    def poll(self, timeout: float) -> list[tuple[int, str | None]]:
        e = self.backend._e
        deadline = time.monotonic() + timeout
        while True:
            npolled, wcs = self.cq.poll(num_entries=self.backend.depth)
            if npolled:
                return [(wc.wr_id, None if wc.status == e.IBV_WC_SUCCESS else
                         f"work completion status {wc.status} (vendor error "
                         f"{wc.vendor_err})") for wc in wcs[:npolled]]
            if time.monotonic() > deadline:
                return []

    def close(self) -> None:
        self.qp.close()
        self.cq.close()
