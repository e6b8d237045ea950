"""Tinker wire types: decoded at the edge into the library's own types, encoded back for the SDK."""
