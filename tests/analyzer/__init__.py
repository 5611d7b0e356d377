"""Tests of tensorx.graph_analyzer (tensorx._analyzer): plans, balance, binding, staging."""
