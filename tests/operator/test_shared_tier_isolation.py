"""Two KVCaches on one shared tier never share keys unless told to."""

from __future__ import annotations

from kvstrata.operator import spec as S

EXTERNAL = {"backend": "valkey", "valkey": {"external": {"url": "redis://valkey.shared:6379/0"}}}


def test_two_kvcaches_on_one_valkey_get_key_prefixes_of_their_own(make_kvcache):
    a, _ = S.render_sidecar_config(make_kvcache("a", "team-1", shared=EXTERNAL))
    b, _ = S.render_sidecar_config(make_kvcache("b", "team-1", shared=EXTERNAL))
    c, _ = S.render_sidecar_config(make_kvcache("a", "team-2", shared=EXTERNAL))
    prefixes = {x.shared.valkey.key_prefix for x in (a, b, c)}
    assert len(prefixes) == 3
    assert a.shared.valkey.key_prefix == "kvstrata:team-1/a:"


def test_a_key_prefix_in_the_spec_is_kept(make_kvcache):
    shared = {"backend": "valkey", "valkey": {**EXTERNAL["valkey"], "keyPrefix": "shared:"}}
    config, _ = S.render_sidecar_config(make_kvcache("a", "team-1", shared=shared))
    assert config.shared.valkey.key_prefix == "shared:"


S3 = {"backend": "s3", "s3": {"bucket": "shared-bucket"}}


def test_two_kvcaches_on_one_bucket_get_object_prefixes_of_their_own(make_kvcache):
    a, _ = S.render_sidecar_config(make_kvcache("a", "team-1", shared=S3))
    b, _ = S.render_sidecar_config(make_kvcache("b", "team-1", shared=S3))
    c, _ = S.render_sidecar_config(make_kvcache("a", "team-2", shared=S3))
    assert len({x.shared.s3.prefix for x in (a, b, c)}) == 3
    assert a.shared.s3.prefix == "kvstrata/team-1/a/"


def test_an_s3_prefix_in_the_spec_is_kept(make_kvcache):
    shared = {"backend": "s3", "s3": {**S3["s3"], "prefix": "pool/"}}
    config, _ = S.render_sidecar_config(make_kvcache("a", "team-1", shared=shared))
    assert config.shared.s3.prefix == "pool/"


def test_the_managed_valkey_confines_its_sidecars_user_to_the_caches_prefix(make_kvcache):
    from kvstrata.operator import resources

    managed = {"backend": "valkey", "valkey": {"managed": {}}}
    config, _ = S.render_sidecar_config(make_kvcache("a", "team-1", shared=managed))
    assert config.shared.valkey.username == S.MANAGED_VALKEY_USER
    args = resources.valkey_acl_args(config.shared.valkey.key_prefix)
    assert f"'~{config.shared.valkey.key_prefix}*'" in args
    assert "--user default off" in args
