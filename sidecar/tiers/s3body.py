"""A GET's body read into buffers the caller names: the S3 tier's stream for
:func:`.placing.receive_into`.

Why reach under botocore: ``StreamingBody.read`` hands back a new ``bytes``
per call (for a whole object, one allocation of its size, whose pages the
first write then faults in, one by one), and urllib3's ``readinto`` copies
through such a ``bytes``. Here the body is read with http.client's own
``HTTPResponse.readinto`` straight into the destination (an L1 slot): one
copy, by the kernel, and a piece at a time so that each piece is hashed
while it is still in cache.

Facts relied on, read in the installed sources (botocore 1.44, urllib3 2.8,
CPython 3.11) and pinned by ``tests/integration/remote/test_s3_get_into.py``:
``StreamingBody._raw_stream`` is urllib3's ``HTTPResponse``, whose ``_fp`` is
http.client's ``HTTPResponse``; that one reads a Content-Length body with
``readinto`` and closes itself after the last byte; urllib3's public
``release_conn`` then puts the connection back in the pool. The socket keeps
the client's read timeout. Where any of it is missing (another botocore, an
encoded body), the body's public ``read`` is used, a piece at a time.
"""

from __future__ import annotations

import contextlib
import http.client
import time
from typing import Any

from kvstrata.sidecar.tiers.placing import Receiver

__all__ = ["PIECE_BYTES", "BodyStream"]

# Read and hash in pieces this large: a piece is hashed right after it lands,
# while it is still in the CPU's cache (a few MiB of L2 on the benchmark VMs).
PIECE_BYTES = 1 << 20


class BodyStream:
    """One GET response's body, read in order (module docstring).

    Raises :class:`TimeoutError` past ``deadline`` (checked between pieces;
    each read also has the socket's own timeout) and :class:`ConnectionError`
    when the body ends before its Content-Length. :meth:`finish` always runs
    after the last read: the connection goes back to the pool only when the
    body was read to its end, else it is closed.
    """

    def __init__(self, response: dict[str, Any], deadline: float) -> None:
        self._body = response["Body"]
        self.size = int(response["ContentLength"])
        self._left = self.size
        self._deadline = deadline
        self._skipped = False
        self._raw = getattr(self._body, "_raw_stream", None)  # urllib3's HTTPResponse
        fp = getattr(self._raw, "_fp", None)  # http.client's HTTPResponse
        encoded = response.get("ContentEncoding") not in (None, "", "identity")
        self._readinto = (
            fp.readinto if isinstance(fp, http.client.HTTPResponse) and not encoded else None
        )

    @property
    def zero_copy(self) -> bool:
        """Whether the body is received straight into the caller's buffers."""
        return self._readinto is not None

    def fill(self, out: memoryview, hasher: Receiver | None = None, base: int = 0) -> None:
        """Fill ``out`` exactly; ``hasher`` hears ``base`` + the bytes filled so far."""
        filled = 0
        while filled < len(out):
            if time.monotonic() > self._deadline:
                raise TimeoutError(f"GET body not read within its deadline ({self._left} left)")
            n = self._read_into(out[filled : filled + PIECE_BYTES])
            if n == 0:
                raise ConnectionError(f"GET body ended {self._left} bytes before its length")
            filled += n
            self._left -= n
            if hasher is not None:
                hasher.received(base + filled)

    def skip(self, n: int) -> None:
        """The rest is not wanted: it is not read (:meth:`finish` closes the connection)."""
        self._skipped = True

    def finish(self) -> None:
        if self._left == 0 and not self._skipped:
            if self._readinto is not None:
                self._raw.release_conn()  # type: ignore[union-attr]
                return
            with contextlib.suppress(Exception):
                self._body.read()  # b"": urllib3 sees the end and releases the connection
                return
        with contextlib.suppress(Exception):
            self._body.close()

    def _read_into(self, piece: memoryview) -> int:
        if self._readinto is not None:
            return int(self._readinto(piece))
        data = self._body.read(len(piece))
        piece[: len(data)] = data
        return len(data)
