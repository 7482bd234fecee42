"""A sampler node's side of the learner service (`service.py`): Arrow Flight calls with the
shared token, weights fetched in parallel chunk streams and verified, groups uploaded."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Optional

import numpy as np
import pyarrow.flight as flight

from jaxrl_llm.runtime import wire

STREAMS = 4  # parallel chunk streams per weights fetch


class Client:
    def __init__(self, address: str, token: str = "", tls_root_cert: Optional[bytes] = None, timeout: float = 30.0):
        """`address`: HOST:PORT; `tls_root_cert`: PEM of the learner's (e.g. self-signed) certificate."""
        scheme = "grpc+tls" if tls_root_cert else "grpc+tcp"
        self.address = address
        self._flight = flight.FlightClient(f"{scheme}://{address}", tls_root_certs=tls_root_cert)
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(headers=headers, timeout=timeout)
        self._pool = concurrent.futures.ThreadPoolExecutor(STREAMS, thread_name_prefix="weights")

    def call(self, action: str, **body) -> dict:
        results = self._flight.do_action(flight.Action(action, json.dumps(body).encode()), options=self._options)
        return json.loads(b"".join(r.body.to_pybytes() for r in results))

    def fetch_weights(self, manifest: dict, like):
        """The params of `manifest`'s version, in the tree of `like`; every chunk is checked."""
        buf = np.empty(manifest["nbytes"], np.uint8)

        def one(i):
            ticket = flight.Ticket(json.dumps({"version": manifest["version"], "chunk": i}).encode())
            col = self._flight.do_get(ticket, options=self._options).read_all().column("data").chunk(0)
            data = memoryview(col.buffers()[2])[: manifest["chunks"][i]["nbytes"]]
            wire.check_chunk(manifest, i, data)
            o = manifest["chunks"][i]["offset"]
            buf[o:o + len(data)] = np.frombuffer(data, np.uint8)

        list(self._pool.map(one, range(len(manifest["chunks"]))))
        return wire.unpack_params(manifest, buf, like)

    def put_group(self, batch, **meta) -> dict:
        """Upload one scored prompt group (a host batch) with its lease metadata."""
        table = wire.encode_group(batch)
        desc = flight.FlightDescriptor.for_command(json.dumps(meta).encode())
        writer, reader = self._flight.do_put(desc, table.schema, options=self._options)
        try:
            writer.write_table(table)
            writer.done_writing()
            answer = reader.read()
        finally:
            writer.close()
        return json.loads(answer.to_pybytes()) if answer is not None else {}

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._flight.close()
