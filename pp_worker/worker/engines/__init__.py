"""Engines: the stub (no tinygrad) and the tinygrad engine, behind one interface (base.Engine)."""
