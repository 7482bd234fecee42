"""A sampler node's side of the learner service (`service.py`): Arrow Flight calls with the
shared token, weights fetched in parallel chunk streams and verified, groups uploaded."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Optional

import pyarrow as pa
import pyarrow.flight as flight

from jaxrl_llm.remote import wire

STREAMS = 4  # parallel chunk streams per weights fetch, each on a connection of its own
# HTTP/2 frames as large as the protocol allows, and a channel per stream (gRPC would otherwise
# share one connection): the two settings that raised loopback fetches the most (experiments/bench_remote.py).
_BULK = [("grpc.http2.max_frame_size", (1 << 24) - 1), ("grpc.use_local_subchannel_pool", 1)]


class Client:
    def __init__(self, address: str, token: str = "", tls_root_cert: Optional[bytes] = None, timeout: float = 30.0):
        """`address`: HOST:PORT; `tls_root_cert`: PEM of the learner's (e.g. self-signed) certificate."""
        scheme = "grpc+tls" if tls_root_cert else "grpc+tcp"
        self.address = address
        where = f"{scheme}://{address}"
        self._flight = flight.FlightClient(where, tls_root_certs=tls_root_cert)
        self._bulk = [flight.FlightClient(where, tls_root_certs=tls_root_cert,
                                          generic_options=_BULK + [("jaxrl.stream", i)]) for i in range(STREAMS)]
        self._headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(headers=self._headers, timeout=timeout)
        self._pool = concurrent.futures.ThreadPoolExecutor(STREAMS, thread_name_prefix="weights")

    def call(self, action: str, *, timeout: Optional[float] = None, **body) -> dict:
        """One action; `timeout` (seconds) replaces the client's own for this call."""
        options = self._options if timeout is None else flight.FlightCallOptions(headers=self._headers, timeout=timeout)
        results = self._flight.do_action(flight.Action(action, json.dumps(body).encode()), options=options)
        return json.loads(b"".join(r.body.to_pybytes() for r in results))

    def fetch_weights(self, manifest: dict, like):
        """(params of `manifest`'s version in the tree of `like`, the CRC32Cs of the chunks as
        received); every chunk is checked."""
        def one(i):
            ticket = flight.Ticket(json.dumps({"version": manifest["version"], "chunk": i}).encode())
            col = self._bulk[i % STREAMS].do_get(ticket, options=self._options).read_all().column("data").chunk(0)
            data = col.buffers()[2]  # an Arrow buffer, read in place
            return data, wire.check_chunk(manifest, i, memoryview(data)[: manifest["chunks"][i]["nbytes"]])

        got = list(self._pool.map(one, range(len(manifest["chunks"]))))
        return wire.unpack_params(manifest, [data for data, _ in got], like), [crc for _, crc in got]

    def put_groups(self, groups, **session) -> list:
        """Upload scored prompt groups [(host batch, {"lease", "group", ...})] in one stream;
        returns the learner's result per group ({"accepted": True} or {"rejected": why})."""
        tables = [wire.encode_group(batch) for batch, _ in groups]
        desc = flight.FlightDescriptor.for_command(json.dumps(session).encode())
        writer, reader = self._flight.do_put(desc, tables[0].schema, options=self._options)
        try:
            for table, (_, meta) in zip(tables, groups):
                for batch in table.to_batches():
                    writer.write_with_metadata(batch, pa.py_buffer(json.dumps(meta).encode()))
            writer.done_writing()
            answer = reader.read()
        finally:
            writer.close()
        return json.loads(answer.to_pybytes())

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in [self._flight, *self._bulk]:
            c.close()
