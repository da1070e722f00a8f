"""Benchmarks behind ``kvwire bench ...``: each suite prints a table and can write JSON and a plot."""
