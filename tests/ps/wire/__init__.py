"""Tests of the PS wire format (tensorx._ps.wire): the verify checksum and its protocol."""
