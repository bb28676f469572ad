"""Triton's HTTP/REST inference protocol with the binary tensor extension, on the standard
library alone (``http.client``): for machines without ``tritonclient`` (a GPU node with no
network), the GPU check and its load generator.

A request body is the JSON inference header followed by the inputs' raw bytes, its length
in the ``Inference-Header-Content-Length`` header; the response is laid out the same way
(KServe v2 protocol, Triton's ``binary_data`` extension).
"""

from __future__ import annotations

import http.client
import json
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

#: numpy dtype -> Triton datatype name (the ones this project's models take and give)
DATATYPES: Dict[np.dtype, str] = {
    np.dtype(np.float32): "FP32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.int32): "INT32",
    np.dtype(np.uint32): "UINT32",
}
_NUMPY: Dict[str, np.dtype] = {v: k for k, v in DATATYPES.items()}


class InferError(RuntimeError):
    """The server answered a request with an error (its HTTP status and message)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def encode_request(
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str],
    parameters: Optional[Mapping[str, object]] = None,
) -> Tuple[bytes, int]:
    """The body of an inference request and the length of its JSON header."""
    arrays = {n: np.ascontiguousarray(a) for n, a in inputs.items()}
    header = {
        "inputs": [
            {
                "name": n,
                "shape": list(a.shape),
                "datatype": DATATYPES[a.dtype],
                "parameters": {"binary_data_size": a.nbytes},
            }
            for n, a in arrays.items()
        ],
        "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outputs],
    }
    if parameters:
        header["parameters"] = dict(parameters)
    head = json.dumps(header).encode()
    return head + b"".join(a.tobytes() for a in arrays.values()), len(head)


def decode_response(body: bytes, header_length: int) -> Dict[str, np.ndarray]:
    """The output tensors of a response body."""
    header = json.loads(body[:header_length])
    out: Dict[str, np.ndarray] = {}
    pos = header_length
    for o in header.get("outputs", []):
        dtype = _NUMPY[o["datatype"]]
        size = int(o.get("parameters", {}).get("binary_data_size", 0))
        if size:
            a = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=pos)
            pos += size
        else:
            a = np.asarray(o.get("data", []), dtype=dtype)
        out[o["name"]] = a.reshape(o["shape"])
    return out


class Client:
    """One keep-alive connection to a server's HTTP port (not thread-safe)."""

    def __init__(self, url: str, timeout: float = 60.0):
        host, port = url.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout)

    def post(self, model: str, body: bytes, header_length: int) -> Tuple[int, bytes, int]:
        """Send a prepared body; (HTTP status, response body, its header length)."""
        self.conn.request(
            "POST",
            f"/v2/models/{model}/infer",
            body=body,
            headers={"Inference-Header-Content-Length": str(header_length)},
        )
        r = self.conn.getresponse()
        data = r.read()
        hl = r.getheader("Inference-Header-Content-Length")
        return r.status, data, int(hl) if hl is not None else len(data)

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] = ("OUTPUT0",),
        parameters: Optional[Mapping[str, object]] = None,
    ) -> Dict[str, np.ndarray]:
        """The outputs of one request (InferError for an error answer)."""
        body, hl = encode_request(inputs, outputs, parameters)
        status, data, rhl = self.post(model, body, hl)
        if status != 200:
            try:
                message = json.loads(data).get("error", data.decode(errors="replace"))
            except ValueError:
                message = data.decode(errors="replace")
            raise InferError(status, message)
        return decode_response(data, rhl)

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()
