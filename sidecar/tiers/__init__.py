"""Tiers below L1: local disk (L2) and the shared tier (Valkey or S3).

Every tier implements :class:`kvstrata.sidecar.tiers.base.Tier` and stores
objects in the format of :mod:`kvstrata.sidecar.objformat`.
"""
