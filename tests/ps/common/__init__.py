"""Tests of the PS's shared pieces (tensorx._ps.common): rendezvous and remembered choices."""
