"""Names and label values derived from a KVCache name: always ones the API server takes.

Why this module exists: a KVCache name is any DNS-1123 subdomain (up to 253
characters, dots allowed), but what the operator builds from it is held to
tighter rules: a Service name is an RFC 1035 label (at most 63 characters,
starting with a letter), a StatefulSet name at most 52 (below), a label value
at most 63. ``NAME-metrics`` from a 63-character name is already refused. So
each derived name is the plain ``NAME-SUFFIX`` when that is legal, else a
shortened, sanitised head of the name plus a hash of the whole name, the way
Helm charts truncate (``trunc 63``) and add a digest: deterministic, so every
pass and every webhook call derives the same name, and two KVCache names that
share a long head still get different objects.

The rules, from the Kubernetes validation source (apimachinery
``pkg/util/validation/validation.go``):

* ``IsDNS1123Subdomain``: at most 253, ``[a-z0-9]([-a-z0-9]*[a-z0-9])?`` labels joined by dots
  (ConfigMap, Secret, StatefulSet, Deployment, custom resource names).
* ``IsDNS1035Label``: at most 63, ``[a-z]([-a-z0-9]*[a-z0-9])?`` (Service names,
  ``ValidateServiceName`` in ``pkg/apis/core/validation``).
* ``IsValidLabelValue``: at most 63, empty or ``[A-Za-z0-9]`` at both ends with ``-_.`` inside.
* StatefulSet: the controller labels each revision ``controller-revision-hash: NAME-HASH``
  (HASH up to 10 characters plus the dash), which must be a label value, so a StatefulSet
  name longer than 52 characters leaves its pods uncreatable (kubernetes/kubernetes#64023).
"""

from __future__ import annotations

import hashlib
import re

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
DNS1035_LABEL_MAX = 63
LABEL_VALUE_MAX = 63
STATEFULSET_NAME_MAX = 52
HASH_CHARS = 8

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_dns1123_label(value: str) -> bool:
    return len(value) <= DNS1123_LABEL_MAX and bool(DNS1123_LABEL.match(value))


def is_dns1123_subdomain(value: str) -> bool:
    return len(value) <= DNS1123_SUBDOMAIN_MAX and bool(DNS1123_SUBDOMAIN.match(value))


def is_dns1035_label(value: str) -> bool:
    return len(value) <= DNS1035_LABEL_MAX and bool(DNS1035_LABEL.match(value))


def is_label_value(value: str) -> bool:
    return len(value) <= LABEL_VALUE_MAX and bool(LABEL_VALUE.match(value))


def name_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:HASH_CHARS]


def child_name(name: str, suffix: str, limit: int = DNS1035_LABEL_MAX) -> str:
    """``NAME-SUFFIX`` as an RFC 1035 label of at most ``limit`` characters.

    Kept as is when legal; else the name's head (dots and other characters
    outside ``[a-z0-9-]`` as dashes, a leading ``k`` when it starts with a
    digit) cut to fit, then ``-HASH-SUFFIX``. ``suffix`` must itself end in a
    letter or digit.
    """
    plain = f"{name}-{suffix}"
    if len(plain) <= limit and DNS1035_LABEL.match(plain):
        return plain
    head = re.sub(r"[^a-z0-9-]", "-", name.lower())
    if not head[:1].isalpha():
        head = "k" + head
    keep = limit - len(suffix) - HASH_CHARS - 2
    head = head[:keep].rstrip("-")
    return f"{head}-{name_hash(name)}-{suffix}"


def label_value(name: str) -> str:
    """``name`` when it is a legal label value, else its head and a hash (63 characters)."""
    if is_label_value(name):
        return name
    head = name[: LABEL_VALUE_MAX - HASH_CHARS - 1].rstrip("-_.")
    return f"{head}-{name_hash(name)}" if LABEL_VALUE.match(head) else name_hash(name)
