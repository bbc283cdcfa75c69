"""How long a sidecar lease still pins its arena slot, seen from the connector.

A lease pins its slot for the sidecar's ``lease_seconds`` (HELLO says how
long), counted from when the sidecar granted it; after that the sidecar may
give the slot to another chunk. The connector cannot see the grant, but it
knows when it asked, which is earlier, and both run on one node's monotonic
clock: so a lease asked for at ``asked_at`` surely pins its slot until
``asked_at + lease_seconds``, and only within the session that granted it
(another session's sidecar may have given every slot away).

Readers check after their copies (:mod:`.leased_reads`): a copy that ended
in time read the leased chunk. Writers check before theirs
(:mod:`.transfer_path`), keeping half the lease for the copy itself, since
a write that ran late could land in a slot another chunk now owns.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.connector.client import SidecarClient

WRITE_SHARE = 0.5  # a write starts only in the first half of its lease


def still_pinned(client: SidecarClient, asked_at: float, epoch: int, share: float = 1.0) -> bool:
    """Whether leases ``client`` asked for at ``asked_at`` (``time.monotonic``)
    in session ``epoch`` still pin their slots, and will for the rest of the
    first ``share`` of their time."""
    if client.epoch != epoch:
        return False
    return time.monotonic() < asked_at + share * client.lease_seconds
