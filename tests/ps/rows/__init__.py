"""Tests of sparse rows on the PS (tensorx._ps.rows): pushes, pulls, receipt, state, adversity."""
