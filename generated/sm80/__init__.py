"""The bundled specs' modules for sm80 (A100): `from generated.sm80.<name> import attention`.
See generated/__init__.py."""
