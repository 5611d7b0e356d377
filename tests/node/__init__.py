"""Tests of tensorx.node and tensorx.endpoint: connections, exports, rows, reconnects."""
