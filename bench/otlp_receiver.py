"""A minimal OTLP/HTTP trace receiver for the benchmarks: POST /v1/traces with protobuf
bodies, decoded and counted; GET /count answers how many spans arrived.

Run: `.venv/bin/python bench/otlp_receiver.py --port 4318` (overhead.py --trace starts it).
"""

from __future__ import annotations

import argparse
import sys

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

SPANS = web.AppKey("spans", list)


async def traces(request: web.Request) -> web.Response:
    export = ExportTraceServiceRequest()
    export.ParseFromString(await request.read())
    request.app[SPANS][0] += sum(
        len(scope.spans) for resource in export.resource_spans for scope in resource.scope_spans
    )
    return web.Response(
        body=ExportTraceServiceResponse().SerializeToString(),
        content_type="application/x-protobuf",
    )


async def count(request: web.Request) -> web.Response:
    return web.json_response({"spans": request.app[SPANS][0]})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SPANS] = [0]
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/count", count)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
