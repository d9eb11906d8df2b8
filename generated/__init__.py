"""The modules dilgen emits for the bundled specs (examples/specs/*.json): open one to see
what dilgen generates. Plain Python + Triton, written by `dilgen compile` from the
repository root; each opens with a header naming its spec, spec hash, target and dilgen
version.

    generated/<name>.py          sm90, the default --arch   `dilgen compile examples/specs/<name>.json`
    generated/sm80/<name>.py     sm80 (generated/<arch>/)   `dilgen compile examples/specs/<name>.json --arch sm80`

Import one from the repository root (or with it on PYTHONPATH); nothing is planned or
emitted again:

    from generated.longnet_base import attention          # sm90
    from generated.sm80.longnet_base import attention     # sm80

tests/test_generated.py compiles every bundled spec afresh and compares it byte for byte
with these files; after an intended change, `DILGEN_UPDATE_GOLDEN=1 python -m pytest
tests/test_generated.py` rewrites them. Modules of your own specs compiled here are yours:
they are not part of the repository.
"""
