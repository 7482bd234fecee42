"""The learner's network service: Arrow Flight (gRPC underneath) on `runtime.remote.host:port`.

  actions (JSON in, JSON out)  hello, lease, heartbeat, release, manifest
  do_get  {"version", "chunk"}  one chunk of a published weights artifact (`wire.pack_params`)
  do_put  {"run_id", "node"} + record batches, each one scored prompt group (`wire.encode_group`)
          with its {"lease", "group"} as metadata; answers one result per group

This module is the transport only: a `handler` (the remote mode, `mode.py`) answers each
call. Every call carries the shared token as a bearer header, checked before the handler runs
(`TokenCheck`, which slows a guesser down); with `tls` the server speaks TLS. A refusal reaches
the node as one line, never a traceback: a refused token, a refused node (PermissionError), a
rejected message (`wire.Rejected`), or "internal error" (the learner logs the traceback). Every
refusal is counted by reason (`handler.refuse`). Requests are bounded before they are parsed
(MAX_REQUEST_BYTES, MAX_META_BYTES), and a put stream's session is checked before its first group
is read. gRPC itself reads each message whole: pyarrow's Flight server exposes no receive limit
(apache/arrow#40257), so a token holder can make the learner hold one message (at most 2 GiB, the
protobuf limit) per call before it is refused.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight


ACTIONS = ("hello", "lease", "heartbeat", "release", "manifest")
MAX_REQUEST_BYTES = 64 << 10  # an action's JSON body or a ticket
MAX_META_BYTES = 16 << 10  # a put group's JSON metadata (its weights fingerprints: one per version)
log = logging.getLogger(__name__)


class TokenCheck(flight.ServerMiddlewareFactory):
    """Refuses every call whose `authorization` header is not `Bearer <token>` (counted); with
    no token (loopback only, `remote.validate`) every call passes. A throttle: past `burst`
    refusals within a second, each further refusal first waits `delay_s` (a guesser gets a few
    tries a second per connection; a caller with the token is never delayed)."""

    def __init__(self, token: str, count=lambda reason: None, burst: int = 20, delay_s: float = 0.25,
                 clock=time.monotonic, sleep=time.sleep):
        self.token, self.count, self.burst, self.delay_s = token, count, burst, delay_s
        self.clock, self.sleep = clock, sleep
        self.refused = 0
        self._recent: list = []  # when the latest refusals were
        self._lock = threading.Lock()

    def start_call(self, info, headers):
        got = (headers.get("authorization") or [""])[0]
        if isinstance(got, bytes):
            got = got.decode(errors="replace")
        if self.token and not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            with self._lock:
                now = self.clock()
                self._recent = [t for t in self._recent if now - t < 1.0][-self.burst:] + [now]
                self.refused += 1
                throttled = len(self._recent) > self.burst
            self.count("throttled" if throttled else "token")
            if throttled:
                self.sleep(self.delay_s)
            raise flight.FlightUnauthenticatedError(
                "refused: this learner requires its shared token (runtime.remote.token / JAXRL_REMOTE_TOKEN); "
                + ("none was sent" if not got else "the one sent does not match"))
        return None


class Service(flight.FlightServerBase):
    def __init__(self, handler, host: str, port: int, token: str = "", tls=None):
        """`tls`: (certificate PEM bytes, key PEM bytes) or None."""
        scheme = "grpc+tls" if tls else "grpc+tcp"
        self.count = getattr(handler, "refuse", lambda reason: None)
        self.auth = TokenCheck(token, self.count)
        super().__init__(f"{scheme}://{host}:{port}", middleware={"auth": self.auth},
                         tls_certificates=[flight.CertKeyPair(*tls)] if tls else None)
        self.handler, self.host = handler, host
        self._thread = threading.Thread(target=self.serve, daemon=True, name="learner-service")
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def do_action(self, context, action):
        name = action.type
        if name not in ACTIONS:
            self.count("request")
            raise flight.FlightServerError(f"unknown action {name[:40]!r}; valid: {', '.join(ACTIONS)}")
        req = self._json(action.body.to_pybytes(), MAX_REQUEST_BYTES)
        req["peer"] = context.peer()
        out = self._guard(getattr(self.handler, name), req)
        return [json.dumps(out).encode()]

    def list_actions(self, context):
        return [(a, "") for a in ACTIONS]

    def do_get(self, context, ticket):
        req = self._json(ticket.ticket, MAX_REQUEST_BYTES)
        data = self._guard(self.handler.chunk, req)
        arr = pa.Array.from_buffers(pa.large_binary(), 1, [None, pa.py_buffer(_offsets(len(data))), pa.py_buffer(data)])
        return flight.RecordBatchStream(pa.table({"data": arr}))

    def do_put(self, context, descriptor, reader, writer):
        """A stream of groups: each record batch one group, its metadata {"lease", "group", ...};
        answers one result per group (a refused group does not end the stream). The stream's
        session is checked before its first group is read."""
        session = self._json(descriptor.command, MAX_REQUEST_BYTES)
        self._guard(getattr(self.handler, "check_session", lambda req: None), dict(session))
        results = []
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            try:
                meta = self._json(chunk.app_metadata.to_pybytes() if chunk.app_metadata else b"", MAX_META_BYTES)
                # The stream's session fields last: a group's metadata cannot name another session.
                req = {**meta, **session, "table": pa.Table.from_batches([chunk.data])}
                results.append(self._guard(self.handler.put_group, req))
            except flight.FlightUnauthorizedError:
                raise
            except flight.FlightError as e:
                results.append({"rejected": str(e)})
        writer.write(pa.py_buffer(json.dumps(results).encode()))

    def close(self) -> None:
        self.shutdown()
        self._thread.join(timeout=10)

    def _json(self, raw: bytes, limit: int) -> dict:
        """A request's JSON object, refused (counted) past `limit` bytes or when it is not one."""
        req = None
        if len(raw) <= limit:
            try:
                req = json.loads(raw or b"{}")
            except ValueError:
                pass
        if not isinstance(req, dict):
            self.count("request")
            raise flight.FlightServerError(f"rejected: the request is not a JSON object of at most {limit} bytes")
        return req

    def _guard(self, fn, req):
        """Run a handler call; its refusals reach the node as one-line Flight errors, counted
        here unless the handler did (`counted`); anything else is logged here and reaches the
        node as "internal error"."""
        try:
            return fn(req)
        except (PermissionError, ValueError, LookupError, TypeError) as e:  # Rejected, LeaseError, a bad field
            if not getattr(e, "counted", False):
                self.count("request")
            if isinstance(e, PermissionError):
                raise flight.FlightUnauthorizedError(f"refused: {e}") from None
            raise flight.FlightServerError(f"rejected: {type(e).__name__}: {e}") from None
        except Exception as e:
            self.count("internal")
            log.exception("the learner's service failed on a %s call", getattr(fn, "__name__", "?"))
            raise flight.FlightServerError(f"internal error on the learner ({type(e).__name__}); "
                                           "it is logged there") from None


def _offsets(n: int) -> bytes:
    return np.array([0, n], np.int64).tobytes()


