"""Test support shipped with kvwire: harnesses, fakes and peer processes for the tests and the tools.

Every harness lives here and nowhere else (the connector pair ``connector_env``, the cores' drivers
``cores_env``, the fault cluster ``faults_env``, the simulator, peer processes); product modules never
import it (the tools in ``kvwire_tools``, which are test infrastructure themselves, may). It imports no
pytest (``tests/unit/test_testing_kit.py``): an engine's own runner can use it. The transport
conformance suite is ``kvwire.testing.conformance``.
"""
