"""Tests of tensorx.transport: the wire format, the control channel, every data lane."""
