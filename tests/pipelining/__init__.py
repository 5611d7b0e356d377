"""Tests of tensorx.pipelining: splitting a model, stages, schedules, pipeline x PS."""
