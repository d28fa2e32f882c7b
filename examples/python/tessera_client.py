#!/usr/bin/env python3
"""A small client of tesserad's node API (tessera.v1.Node) with stock grpcio.

It carves a GPU share, prints the environment a process needs to use it, changes its limits,
lists allocations and releases it -- what a function platform does per request (see
docs/serverless.md). The Python modules are generated from proto/ at run time (nothing
generated is committed); grpcio's default channel settings are used as they are: tesserad
accepts the `:authority` grpcio sends on a Unix socket.

Needs: grpcio and grpcio-tools (pip install grpcio grpcio-tools), and root (the node API
socket is owner-only).

    python3 examples/python/tessera_client.py [--socket /run/tessera/tessera.sock] \
        [--memory-mib 1024] [--sm 25] [--owner fn-demo]

Prints one JSON object per step, one per line.
"""

import argparse
import importlib
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(HERE, "..", "..", "proto", "proto")


def generate(out_dir):
    """Compiles tessera/v1/node.proto into out_dir and returns (messages, stubs)."""
    from grpc_tools import protoc

    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            "tessera/v1/node.proto",
        ]
    )
    if rc != 0:
        sys.exit(f"protoc failed on {PROTO_ROOT}/tessera/v1/node.proto (exit {rc})")
    sys.path.insert(0, out_dir)
    return importlib.import_module("tessera.v1.node_pb2"), importlib.import_module("tessera.v1.node_pb2_grpc")


def step(name, **fields):
    print(json.dumps({"step": name, **fields}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=os.environ.get("TESSERA_SOCKET", "/run/tessera/tessera.sock"))
    ap.add_argument("--memory-mib", type=int, default=1024)
    ap.add_argument("--sm", type=int, default=25)
    ap.add_argument("--owner", default="fn-demo")
    args = ap.parse_args()

    import grpc

    with tempfile.TemporaryDirectory() as gen:
        pb, rpc = generate(gen)
        # The defaults: no grpc.default_authority override.
        with grpc.insecure_channel(f"unix:{args.socket}") as channel:
            node = rpc.NodeStub(channel)

            got = node.Allocate(
                pb.AllocateRequest(
                    memory_bytes=args.memory_mib << 20,
                    sm_percent=args.sm,
                    owner=args.owner,
                    lease=pb.LEASE_NONE,
                )
            )
            alloc = got.allocation
            step(
                "allocate",
                id=alloc.id,
                gpu=alloc.devices[0].uuid,
                memory_limit_bytes=alloc.devices[0].memory_limit_bytes,
                sm_percent=alloc.devices[0].sm_percent,
                cdi_devices=list(got.cdi_devices),
                env=dict(got.env),
            )

            changed = node.SetLimits(
                pb.SetLimitsRequest(allocation_id=alloc.id, sm_percent=min(100, args.sm * 2), priority=pb.PRIORITY_HIGH)
            )
            step("set_limits", id=alloc.id, sm_percent=changed.allocation.devices[0].sm_percent)

            listed = node.ListAllocations(pb.ListAllocationsRequest())
            step("list", ids=[a.id for a in listed.allocations], owners=[a.owner for a in listed.allocations])

            # A refusal is a gRPC status with a message that says what is free.
            try:
                node.Allocate(pb.AllocateRequest(memory_bytes=1 << 60, sm_percent=1))
            except grpc.RpcError as e:
                step("refused", code=e.code().name, message=e.details())

            released = node.Release(pb.ReleaseRequest(allocation_id=alloc.id))
            again = node.Release(pb.ReleaseRequest(allocation_id=alloc.id))
            step("release", released=released.released, released_again=again.released)


if __name__ == "__main__":
    main()
