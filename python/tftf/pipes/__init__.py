"""Pipes: the built-in transformations and the base class of user pipes."""
