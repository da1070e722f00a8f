"""kvwire inside other engines. Each integration imports its engine only in its own modules."""
