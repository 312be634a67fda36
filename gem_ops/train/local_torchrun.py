"""torchrun for one node whose stores listen on the address they are given (the loopback address by
default) rather than on every interface.

torch's TCPStore server binds every interface whatever host name it gets; handed a socket already bound
to that host, it listens there alone. This wraps the agent's store servers (the c10d rendezvous store and
the workers' master store) that way, then runs torchrun's own `main` with the same arguments. The agent
also ends with the process that started it (an asset's step, killed): it gets SIGTERM then, and stops its
ranks as torchrun does on SIGTERM, instead of training on unattended.

    python -m gem_ops.train.local_torchrun --nnodes 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \
        --local-addr 127.0.0.1 --nproc-per-node 2 -m gem_ops.train ...
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

_TCPStore = dist.TCPStore
_LISTENING: list[socket.socket] = []  # the store serves on these: they live as long as the agent


def bound_store(host_name: str, port: int, *args: Any, is_master: bool = False, **kwargs: Any) -> dist.TCPStore:
    """A TCPStore whose server, if it is one, listens on `host_name` alone."""
    if not is_master or kwargs.get("master_listen_fd") is not None:
        return _TCPStore(host_name, port, *args, is_master=is_master, **kwargs)
    family = socket.AF_INET6 if ":" in host_name else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host_name, port))
    listener.listen(socket.SOMAXCONN)
    _LISTENING.append(listener)
    return _TCPStore(host_name, listener.getsockname()[1], *args, is_master=True, master_listen_fd=listener.fileno(),
                     **kwargs)


def end_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux); exits at once if the parent is already gone."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent or parent == 1:
        sys.exit("local_torchrun: the process that started it is gone")


def main() -> None:
    from torch.distributed import run

    end_with_parent()
    dist.TCPStore = bound_store  # the workers' master store (dynamic rendezvous)
    c10d_rendezvous_backend.TCPStore = bound_store  # the rendezvous store
    run.main()


if __name__ == "__main__":
    main()
