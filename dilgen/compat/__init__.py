"""Adapters that let models written for other libraries run on dilgen's kernels.

- `dilgen.compat.torchscale`: torchscale's LongNet `DilatedAttention` (Prov-GigaPath's slide
  encoder), same constructor, forward and parameter names, and `patch(model)`;
  `dilgen.compat.torchscale_seq`: its `args.seq_parallel` path on dilgen's ring.

Nothing in dilgen's core imports this package, and it imports no other library's code:
it recognises their modules by class name and attributes.
"""
