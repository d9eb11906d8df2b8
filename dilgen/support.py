"""What the generated kernels take of a valid spec (SPEC §2.5, issue 16): the fields they
cannot run yet, as one line (planner.plan raises it), and torchscale's layout slip, which
dilgen refuses rather than reproduces."""
from __future__ import annotations

from .spec import Spec

# Issue 16 (torchscale / Prov-GigaPath): the kernels take head_offsets "block",
# short_segments "zero_pad" and head_dim any multiple of 8 on one device (lane kernels);
# planner.plan() raises SpecError with this message for what they still cannot run (a ring).


def unsupported_by_kernels(spec: Spec) -> str | None:
    """One line saying which fields of a valid `spec` the generated kernels cannot run yet
    (in the style of every spec error: source, field, value, why), or None if they can."""
    problems = []
    # the lane kernels take torchscale's layout; a ring keeps every branch in the fused kernel
    if spec.head_offsets != "mod" and spec.ring_size > 1:
        problems.append(f'head_offsets = "{spec.head_offsets}" with ring_size = {spec.ring_size}: '
                        f'the ring kernels take head_offsets "mod" only')
    if spec.short_segments != "exact" and spec.ring_size > 1 and not spec.causal:
        problems.append(f'short_segments = "{spec.short_segments}" with ring_size = '
                        f'{spec.ring_size}: the ring kernels take short_segments "exact" only '
                        f'(or causal specs, which see no zero keys)')
    if not problems:
        return None
    return (f"{spec.source}: " + "; ".join(problems)
            + " (issue 16; dilgen.reference computes these specs in float64)")


def zero_pad_layout_slip(spec: Spec, seq_len: int) -> str | None:
    """The one case of short_segments "zero_pad" that dilgen refuses, as a one-line message
    (None when `seq_len` is fine): torchscale pads each segment of min(w, N) positions to a
    multiple of r, so when min(w, N) is not a multiple of r and there are two or more
    segments (N > w), its branch outputs land on shifted rows; that is not reproduced."""
    if spec.short_segments != "zero_pad":
        return None
    return layout_slip_message(spec.source, spec.segment_lengths, spec.dilation_rates, seq_len)


def layout_slip_message(where: str, segment_lengths, dilation_rates, seq_len: int) -> str | None:
    """The rule of zero_pad_layout_slip on plain values (the runtime holds specs as dicts)."""
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        if seq_len > w and w % r:
            return (f"{where}: N = {seq_len} with segment_lengths[{i}] = {w}, "
                    f"dilation_rates[{i}] = {r}: short_segments \"zero_pad\" needs w to be a "
                    f"multiple of r once N > w (torchscale's layout slip: its outputs of this "
                    f"branch land on shifted rows; dilgen does not reproduce it)")
    return None
