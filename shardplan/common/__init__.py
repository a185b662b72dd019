"""Small helpers every layer shares: dtype names, byte sizes, files written safely."""
