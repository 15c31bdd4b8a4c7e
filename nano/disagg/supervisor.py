"""The workers' lifecycle, seen from the front: spawn, handshake, ready, restart, regroup, kill, close.

Each worker reaches the front's listening socket, and both ends prove they hold NANO_DISAGG_KEY (challenge and
response, before any message is read; then every message carries a MAC, see protocol.py). Handshakes run
concurrently, each in a thread of its own with a short deadline (`protocol.HANDSHAKE_S`), so a silent or slow
client never delays a real worker. The worker says which role it is (`Hello`), the front answers with its
`Setup` (formats, data path), and the worker says `Ready` or `Refused`. A role not in `spawn` is not started here:
the front waits for `python -m nano.disagg ROLE HOST:PORT` to connect, from another host, say. The front also
hosts the data path's shared part: the shared-memory staging buffer, or the TCPStore where gloo groups meet.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from nano.disagg import protocol as p
from nano.disagg.transport import Staging
from nano.engine import EngineConfig
from nano.errors import NanoError, brief
from nano.parallel import bound_store


class Supervisor:
    """The base of `SplitLLM`, which adds the requests: it supplies `poll` (the event loop) and `_lose` (end a
    lost worker's requests), which restart and regroup call."""
    staging: Staging | None = None          # shm: the staging buffer, mapped here too
    store: dist.TCPStore | None = None      # gloo: where the workers' groups meet
    listener: socket.socket | None = None

    def _start_workers(self, model: str, configs: dict[str, EngineConfig], transport: str, spawn: Sequence[str],
                       listen: tuple[str, int], staging_slots: int, slot_bytes: int) -> None:
        self.spawned, self.processes, self.channels = tuple(spawn), {}, {}
        self.info: dict[str, dict[str, Any]] = {}   # each role's worker: its Ready (pid, host, formats, KV tokens)
        self.lost: dict[str, str] = {}              # why each role's last worker was lost
        self.key = os.environ.get("NANO_DISAGG_KEY") or (secrets.token_hex(16) if set(spawn) == set(p.ROLES) else "")
        if not self.key:
            raise NanoError("set NANO_DISAGG_KEY (the same secret on every host) to accept workers from elsewhere")
        try:
            self.listener = socket.create_server(listen)
        except OSError as error:
            raise NanoError(f"cannot listen for workers on {listen[0]}:{listen[1]}: {error.strerror or error}"
                            ) from None
        setup = dict(model=model, transport=transport, timeout_s=self.timeout_s)
        if transport == "shm":
            self.staging = Staging(staging_slots, slot_bytes)
            setup.update(shm_fd=self.staging.fd, slots=staging_slots, slot_bytes=self.staging.slot_bytes)
        else:
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "0")
            try:   # listening on MASTER_ADDR only
                self.store = bound_store(host, int(port), timedelta(seconds=self.timeout_s))
            except (RuntimeError, ValueError, OSError) as error:
                raise NanoError(f"cannot host the TCPStore at MASTER_ADDR={host} MASTER_PORT={port}: "
                                f"{brief(error)}") from None
            setup.update(store_host=host, store_port=self.store.port)
        self.setups = {role: p.Setup(config=configs[role], **setup) for role in p.ROLES}
        for role in spawn:
            self._spawn(role)
        self._accept(p.ROLES)
        self._regroup()

    @property
    def address(self) -> str:
        """Where workers connect: HOST:PORT."""
        host, port = self.listener.getsockname()[:2]
        return f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    def _spawn(self, role: str) -> None:
        """`python -m nano.disagg ROLE HOST:PORT`: a fresh interpreter (nothing of the caller's program is
        re-imported), in its own session (a Ctrl-C reaches the front, which then stops it)."""
        self.processes[role] = subprocess.Popen([sys.executable, "-m", "nano.disagg", role, self.address],
                                                env={**os.environ, "NANO_DISAGG_KEY": self.key},
                                                start_new_session=True,
                                                pass_fds=(self.staging.fd,) if self.staging else ())

    def _accept(self, roles: Sequence[str]) -> None:
        """Take connections until every role in `roles` has a worker that says it is ready (or fail clearly).
        Each connection's handshake runs in its own thread with a short deadline; only those that prove the key
        and say `Hello` for a role still wanted reach this loop, the rest are closed."""
        deadline, pending = time.monotonic() + self.timeout_s, set(roles)
        arrived: queue.Queue[tuple[p.Channel, p.Message]] = queue.Queue()
        open_ = [True]   # handshakes finishing after this call returns close their connections
        lock = threading.Lock()

        def handshake(conn: Connection) -> None:
            try:
                channel = p.open_channel(conn, self.key.encode(), "front")
                with p.receive_timeout(conn, p.HANDSHAKE_S):
                    hello = channel.recv()
            except (EOFError, OSError, NanoError):   # a stranger, another key, too slow, not our protocol
                conn.close()
                return
            with lock:
                if open_[0]:
                    arrived.put((channel, hello))
                    return
            channel.close()

        try:
            while pending:
                for role in pending & set(self.spawned):
                    if self.processes[role].poll() is not None:
                        raise NanoError(f"the {role} worker exited while starting "
                                        f"(exit code {self.processes[role].returncode})")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NanoError(f"no {' or '.join(sorted(pending))} worker connected to {self.address} "
                                    f"within {self.timeout_s:.0f} s")
                while not arrived.empty():
                    channel, hello = arrived.get()
                    if not isinstance(hello, p.Hello) or hello.role not in pending:
                        channel.close()
                        continue
                    channel.send(self.setups[hello.role])
                    self.channels[hello.role] = channel
                    pending.discard(hello.role)
                if not pending or not select.select([self.listener], [], [], min(0.05, remaining))[0]:
                    continue
                conn = Connection(self.listener.accept()[0].detach())
                threading.Thread(target=handshake, args=(conn,), daemon=True, name="nano-disagg-handshake").start()
        finally:
            with lock:
                open_[0] = False
            while not arrived.empty():
                arrived.get()[0].close()
        for role in roles:   # both load their models meanwhile
            self._wait_ready(role)

    def _wait_ready(self, role: str) -> None:
        channel = self.channels[role]
        try:
            if not channel.poll(self.timeout_s):
                raise NanoError(f"the {role} worker did not start within {self.timeout_s:.0f} s")
            ready = channel.recv()
        except (EOFError, OSError):
            code = f" (exit code {self.processes[role].wait()})" if role in self.spawned else ""
            raise NanoError(f"the {role} worker exited while starting{code}") from None
        if not isinstance(ready, p.Ready):
            raise NanoError(f"{role} worker: {getattr(ready, 'error', type(ready).__name__)}")
        self.info[role] = dataclasses.asdict(ready)

    def alive(self, role: str) -> bool:
        return role in self.channels and (role not in self.spawned or self.processes[role].poll() is None)

    def health(self) -> str | None:
        """None while both workers are alive and connected; else, in one line, why one is not."""
        for role in p.ROLES:
            if role not in self.channels:
                return self.lost.get(role, f"no {role} worker")
            if not self.alive(role):
                return self._why_lost(role)
        return None

    def _why_lost(self, role: str) -> str:
        """Why the role's connection closed: the process's exit code, or the remote host."""
        how = (f"died with exit code {self.processes[role].wait()}" if role in self.spawned
               else f"on {self.info[role]['host']} disconnected")
        return f"the {role} worker (pid {self.info[role]['pid']}) {how}"

    def kill(self, role: str) -> None:
        """SIGKILL a spawned worker (what `nano fault --kill-prefill` does)."""
        self.processes[role].kill()
        self.processes[role].wait()

    def restart(self, role: str) -> None:
        """Replace a dead (or live) worker; its in-flight requests end with errors first. A spawned role gets a new
        process; otherwise the front waits for a new worker to connect. With gloo, once both roles are up they
        form a new group."""
        if role in self.spawned:
            self.kill(role)
        if role in self.channels:
            self._lose(role, f"the {role} worker was restarted")
        if role in self.spawned:
            self._spawn(role)
        self._accept([role])
        self._regroup()

    def _regroup(self) -> None:
        """gloo: with both workers up, have them form the data group of a new generation (transfers sent on an
        older one are refused as stale)."""
        if self.store is None:
            return
        self.poll(0.0)   # notice a worker that died meanwhile, before asking it to join
        if set(self.channels) == set(p.ROLES):
            self.generation += 1
            for role in p.ROLES:
                self._send(role, p.Regroup(self.generation))

    def close(self) -> None:
        """Stop the workers: each is told to, and given 5 s to exit; a spawned one still starting (it reads no message
        before it is ready) is killed at once."""
        for channel in self.channels.values():
            try:
                channel.send(p.Stop())
            except OSError:
                pass
        self.store = None   # the TCPStore's port is released with it
        for role, process in self.processes.items():
            if self.info.get(role, {}).get("pid") != process.pid:
                process.kill()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for channel in self.channels.values():
            channel.close()
        self.processes.clear()
        self.channels.clear()
        if self.listener is not None:
            self.listener.close()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
