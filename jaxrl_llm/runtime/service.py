"""The learner's network service: Arrow Flight (gRPC underneath) on `runtime.remote.host:port`.

  actions (JSON in, JSON out)  hello, lease, heartbeat, release, manifest
  do_get  {"version", "chunk"}  one chunk of a published weights artifact (`wire.pack_params`)
  do_put  {"run_id", "node"} + record batches, each one scored prompt group (`wire.encode_group`)
          with its {"lease", "group"} as metadata; answers one result per group

This module is the transport only: a `handler` (the remote mode, `remote.py`) answers each
call. Every call carries the shared token as a bearer header, checked before the handler runs
(`TokenCheck`); with `tls` the server speaks TLS. Errors reach the node with their message:
a refused token, a refused node (PermissionError), a rejected message (`wire.Rejected`).
"""

from __future__ import annotations

import hmac
import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight


ACTIONS = ("hello", "lease", "heartbeat", "release", "manifest")


class TokenCheck(flight.ServerMiddlewareFactory):
    """Refuses every call whose `authorization` header is not `Bearer <token>` (counted); with
    no token (loopback only, `remote.validate`) every call passes."""

    def __init__(self, token: str):
        self.token, self.refused = token, 0

    def start_call(self, info, headers):
        got = (headers.get("authorization") or [""])[0]
        if isinstance(got, bytes):
            got = got.decode(errors="replace")
        if self.token and not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            self.refused += 1
            raise flight.FlightUnauthenticatedError(
                "refused: this learner requires its shared token (runtime.remote.token / JAXRL_REMOTE_TOKEN); "
                + ("none was sent" if not got else "the one sent does not match"))
        return None


class Service(flight.FlightServerBase):
    def __init__(self, handler, host: str, port: int, token: str = "", tls=None):
        """`tls`: (certificate PEM bytes, key PEM bytes) or None."""
        scheme = "grpc+tls" if tls else "grpc+tcp"
        self.auth = TokenCheck(token)
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
            raise flight.FlightServerError(f"unknown action {name!r}; valid: {', '.join(ACTIONS)}")
        req = _json(action.body.to_pybytes())
        req["peer"] = context.peer()
        out = _guard(getattr(self.handler, name), req)
        return [json.dumps(out).encode()]

    def list_actions(self, context):
        return [(a, "") for a in ACTIONS]

    def do_get(self, context, ticket):
        req = _json(ticket.ticket)
        data = _guard(self.handler.chunk, req)
        arr = pa.Array.from_buffers(pa.large_binary(), 1, [None, pa.py_buffer(_offsets(len(data))), pa.py_buffer(data)])
        return flight.RecordBatchStream(pa.table({"data": arr}))

    def do_put(self, context, descriptor, reader, writer):
        """A stream of groups: each record batch one group, its metadata {"lease", "group", ...};
        answers one result per group (a refused group does not end the stream)."""
        session = _json(descriptor.command)
        results = []
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            try:
                meta = _json(chunk.app_metadata.to_pybytes() if chunk.app_metadata else b"")
                # The stream's session fields last: a group's metadata cannot name another session.
                req = {**meta, **session, "table": pa.Table.from_batches([chunk.data])}
                results.append(_guard(self.handler.put_group, req))
            except flight.FlightUnauthorizedError:
                raise
            except flight.FlightError as e:
                results.append({"rejected": str(e)})
        writer.write(pa.py_buffer(json.dumps(results).encode()))

    def close(self) -> None:
        self.shutdown()
        self._thread.join(timeout=10)


def _offsets(n: int) -> bytes:
    return np.array([0, n], np.int64).tobytes()


def _json(raw: bytes) -> dict:
    try:
        req = json.loads(raw or b"{}")
    except ValueError:
        req = None
    if not isinstance(req, dict):
        raise flight.FlightServerError("rejected: the request is not a JSON object")
    return req


def _guard(fn, req):
    """Run a handler call; its refusals reach the node as Flight errors with their message."""
    try:
        return fn(req)
    except PermissionError as e:
        raise flight.FlightUnauthorizedError(f"refused: {e}") from None
    except (ValueError, LookupError, TypeError) as e:  # Rejected, LeaseError, a bad field or index
        raise flight.FlightServerError(f"rejected: {type(e).__name__}: {e}") from None
