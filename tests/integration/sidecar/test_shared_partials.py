"""A full chunk stored through one sidecar deletes, from S3, the partial chunk
another sidecar wrote there: real sidecar processes, a real client, moto's S3."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import boto3

from kvstrata.sidecar.keys import key_hex

NBYTES = 4096
BUCKET = "kvstrata-partials"


def test_a_full_chunk_deletes_the_partial_another_sidecar_wrote_to_s3(
    sidecar_factory: Any, kit: Any, tmp_path: Path
) -> None:
    from kvstrata.testing.servers import MotoS3Server

    (tmp_path / "id").write_text("AK\n")
    (tmp_path / "secret").write_text("SK\n")
    prefix = f"p{uuid.uuid4().hex[:8]}/"
    with MotoS3Server() as s3:
        shared = {
            "backend": "s3",
            "lookup_timeout_seconds": 1.0,
            "s3": {
                "endpoint_url": s3.endpoint_url,
                "bucket": BUCKET,
                "prefix": prefix,
                "create_bucket": True,
                "access_key_id_file": str(tmp_path / "id"),
                "secret_access_key_file": str(tmp_path / "secret"),
            },
        }
        raw = boto3.client(
            "s3",
            endpoint_url=s3.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="AK",
            aws_secret_access_key="SK",
        )

        def stored() -> set[str]:
            listed = raw.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
            return {o["Key"][len(prefix) :] for o in listed}

        a = sidecar_factory("a", {"shared": shared}).start()
        b = sidecar_factory("b", {"shared": shared}).start()
        writer_a, writer_b = a.client(), b.client()
        partial, full = kit.make_keys(2, seed=77)

        slots = writer_a.prepare_store([partial], NBYTES, "uint8", (NBYTES,), "w", blocks=1)
        assert slots is not None and slots[0] is not None, writer_a.errors
        assert writer_a.commit_store([slots[0].lease_id], [True]), writer_a.errors
        kit.wait_until(lambda: key_hex(partial) in stored(), 15, "the partial in S3")

        # Sidecar b never saw the partial: only the shared tier can drop it.
        slots = writer_b.prepare_store(
            [full], NBYTES, "uint8", (NBYTES,), "w", blocks=0, covers=[partial]
        )
        assert slots is not None and slots[0] is not None, writer_b.errors
        assert writer_b.commit_store([slots[0].lease_id], [True]), writer_b.errors
        kit.wait_until(
            lambda: stored() == {key_hex(full)} or None, 15, "the full chunk in, the partial out"
        )
        metrics = b.get("/metrics")
        assert "kvstrata_partial_superseded_deleted_total 1.0" in metrics
        writer_a.close()
        writer_b.close()
        a.stop()
        b.stop()
        raw.close()
