"""kvwire's tools: benches (``kvwire bench ...``), the localhost demo (``kvwire demo``) and chaos
(``kvwire chaos``). A package beside the library, not inside it: ``kvwire`` never imports it (its command
line loads a tool by name when that command runs), so the shipped library carries none of it."""
