"""Placeholder until its commands land."""

COMMANDS: list = []
