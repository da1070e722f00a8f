"""Test support shipped with kvwire: the transport conformance suite (``kvwire.testing.conformance``)."""
