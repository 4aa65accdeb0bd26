"""Retrievers that return prompt-module handles instead of text."""

__all__: list[str] = []
