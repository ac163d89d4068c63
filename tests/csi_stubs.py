"""Python gRPC stubs for the CSI spec, generated from the driver's own vendored proto
(crates/csi/proto/csi.proto) with grpcio-tools, for the tests that call `keel csi` the way
kubelet and the Kubernetes sidecars do."""

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[1] / "crates" / "csi" / "proto"


def generate(out_dir):
    """Generates csi_pb2 / csi_pb2_grpc into out_dir and imports them: (messages, services)."""
    from grpc_tools import protoc

    well_known = Path(protoc.__file__).parent / "_proto"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    code = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--python_out={out_dir}",
                        f"--grpc_python_out={out_dir}", str(PROTO_DIR / "csi.proto")])
    assert code == 0, "generating the CSI stubs failed"
    sys.path.insert(0, str(out_dir))
    import csi_pb2
    import csi_pb2_grpc

    return csi_pb2, csi_pb2_grpc


def connect(socket_path):
    """A channel to a unix socket. gRPC-Python's default authority there is the escaped path,
    which the HTTP/2 server rightly refuses; kubelet (Go) sends "localhost"."""
    import grpc

    return grpc.insecure_channel(f"unix://{socket_path}", options=[("grpc.default_authority", "localhost")])
