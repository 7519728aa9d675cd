"""The sockets between the API server and its engine processes: ZeroMQ with CURVE, keyed from one
shared secret, as vLLM V1's engine-core client talks to its engines.

The server binds a ROUTER (commands out, each to its engine's routing id) and a PULL (every
engine's messages in); an engine connects a DEALER and a PUSH. On one host they meet on ipc://
sockets in a private directory, across nodes on tcp://. Every socket is a CURVE one: the
server's and the engines' key pairs are derived from the secret, and the server's ZAP handler
admits only a peer holding the engines' key. A peer without the secret fails the handshake: the
connection is closed and the server logs one line saying so (a ZAP refusal, or a failed
handshake seen by the socket monitor).

The secret: `CHUNKSERVE_SECRET`, or the file `CHUNKSERVE_SECRET_FILE` names, the same on every
node of `--nnodes`; a one-host server makes a random one of its own and hands it to its children.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
from dataclasses import dataclass

import zmq
import zmq.utils.monitor
import zmq.utils.z85

log = logging.getLogger("chunkserve.server")
SECRET_ENV = "CHUNKSERVE_SECRET"
SECRET_FILE_ENV = "CHUNKSERVE_SECRET_FILE"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
LINGER_MS = 2000  # a closing socket's unsent frames (an engine's last events) get this long
_REFUSED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}


def secret_from_env() -> bytes | None:
    """The shared secret this node was given, or None."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            with open(path, "rb") as f:
                value = f.read().strip()
        except OSError as e:
            raise ValueError(f"{SECRET_FILE_ENV}={path}: cannot read it ({e.strerror})") from e
        if not value:
            raise ValueError(f"{SECRET_FILE_ENV}={path} is empty")
        return value
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def require_secret(what: str) -> bytes:
    """The shared secret, which engines on several nodes need; a clear error without it."""
    secret = secret_from_env()
    if secret is None:
        raise ValueError(f"{what}: set {SECRET_ENV} (or {SECRET_FILE_ENV}, a file holding it) to "
                         f"the same value on every node; node 0 refuses an engine that does not "
                         f"prove it")
    return secret


def local_secret() -> bytes:
    """A one-host server's secret: the node's own when it has one, else a random one."""
    return secret_from_env() or secrets.token_bytes(32)


@dataclass(frozen=True)
class Keys:
    """The CURVE key pairs one secret gives (Z85 text, as ZeroMQ takes them)."""

    server_public: bytes
    server_secret: bytes
    engine_public: bytes
    engine_secret: bytes

    @classmethod
    def of(cls, secret: bytes) -> Keys:
        def pair(role: bytes) -> tuple[bytes, bytes]:
            raw = hashlib.blake2b(secret, digest_size=32, person=role).digest()
            private = zmq.utils.z85.encode(raw)
            return zmq.curve_public(private), private

        (sp, ss), (ep, es) = pair(b"chunkserve-srv"), pair(b"chunkserve-eng")
        return cls(sp, ss, ep, es)


def server_socket(ctx: zmq.Context, kind: int, keys: Keys) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = b"chunkserve"
    sock.linger = 0
    return sock


def engine_socket(ctx: zmq.Context, kind: int, keys: Keys) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.engine_public
    sock.curve_secretkey = keys.engine_secret
    sock.linger = LINGER_MS
    return sock


class Guard:
    """The server side's ZAP handler (admits the engines' key only) and handshake monitors,
    each logging a refused connection; threads of the server's context, stopped by close."""

    def __init__(self, ctx: zmq.Context, keys: Keys) -> None:
        self._ctx = ctx
        self._keys = keys
        self._stop = threading.Event()
        self._zap = ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        self._threads = [threading.Thread(target=self._answer, daemon=True, name="zmq-zap")]
        self._monitors: list[zmq.Socket] = []
        self._threads[0].start()

    def watch(self, sock: zmq.Socket, what: str) -> None:
        """Logs each failed handshake on `sock` (a peer without the secret)."""
        monitor = sock.get_monitor_socket(sum(_REFUSED))
        self._monitors.append(monitor)
        thread = threading.Thread(target=self._report, args=(monitor, what), daemon=True,
                                  name=f"zmq-monitor {what}")
        self._threads.append(thread)
        thread.start()

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        for sock in [self._zap, *self._monitors]:
            sock.close(linger=0)

    def _answer(self) -> None:
        while not self._stop.is_set():
            if not self._zap.poll(100):
                continue
            # ZAP 1.0: version, request id, domain, address, identity, mechanism, credentials
            version, request_id, _domain, address, _identity, mechanism, *creds = (
                self._zap.recv_multipart())
            key = zmq.utils.z85.encode(creds[0]) if mechanism == b"CURVE" and creds else b""
            if key == self._keys.engine_public:
                self._zap.send_multipart([version, request_id, b"200", b"OK", b"", b""])
                continue
            log.error("refused an engine connection from %s: it does not hold this server's "
                      "shared secret (%s)", address.decode(errors="replace") or "?", SECRET_ENV)
            self._zap.send_multipart([version, request_id, b"400", b"no shared secret", b"",
                                      b""])

    def _report(self, monitor: zmq.Socket, what: str) -> None:
        while not self._stop.is_set():
            try:
                if not monitor.poll(100):
                    continue
                event = zmq.utils.monitor.recv_monitor_message(monitor)
            except zmq.ZMQError:
                return  # the socket it watches is closed
            if event["event"] in _REFUSED:
                log.error("refused a connection to the %s socket (%s): its handshake failed, "
                          "so it does not hold this server's shared secret (%s)", what,
                          event["endpoint"].decode(errors="replace"), SECRET_ENV)
