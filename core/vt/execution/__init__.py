"""Execution: one step on one backend (runner, readback, step graphs, memory)."""
