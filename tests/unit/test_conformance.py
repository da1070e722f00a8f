"""Runs the shipped transport conformance suite against every backend (``pytest -k conformance``)."""

from kvwire.testing.conformance import (
    conformance_pair,
    test_conformance_attached_notif_after_data,
    test_conformance_close_idempotent,
    test_conformance_double_release,
    test_conformance_full_peer_write_read,
    test_conformance_metadata_round_trip,
    test_conformance_notif_only_peer,
    test_conformance_post_array,
    test_conformance_post_array_errors,
    test_conformance_registration,
    test_conformance_remove_then_transfer_fails,
    test_conformance_scattered_indices,
)

__all__ = [
    "conformance_pair",
    "test_conformance_attached_notif_after_data",
    "test_conformance_close_idempotent",
    "test_conformance_double_release",
    "test_conformance_full_peer_write_read",
    "test_conformance_metadata_round_trip",
    "test_conformance_notif_only_peer",
    "test_conformance_post_array",
    "test_conformance_post_array_errors",
    "test_conformance_registration",
    "test_conformance_remove_then_transfer_fails",
    "test_conformance_scattered_indices",
]
