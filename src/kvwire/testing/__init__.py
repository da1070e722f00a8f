"""Test support shipped with kvwire: harnesses, fakes and peer processes for the tests and benches.

Every harness lives here and nowhere else; product modules never import it (the benches and the
demos, which are test infrastructure themselves, may). The transport conformance suite is
``kvwire.testing.conformance``.
"""
