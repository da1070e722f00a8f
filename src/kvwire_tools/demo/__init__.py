"""``kvwire demo``: P, D, the router and a colocated reference on localhost, as separate processes."""
