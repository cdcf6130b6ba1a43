"""A check of FP8 payloads shared by the kernel tests."""

import torch


def assert_payload_matches(got, want, fp8, exact):
    """Bitwise equal, or (interpreter) equal except for its fp32->fp8 mis-rounding: a value that should
    round up to a power of two 2^k comes out as 2^(k-1) (the mantissa carry is lost), and subnormals and
    exact ties can land one code (one fp8 ulp) off."""
    if exact:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    expected, value = want.float()[differ], got.float()[differ]
    mantissa, _ = torch.frexp(expected)
    carry_lost = (mantissa.abs() == 0.5) & (value == expected / 2)
    one_ulp = (want.view(torch.uint8)[differ].int() - got.view(torch.uint8)[differ].int()).abs() == 1
    assert (carry_lost | one_ulp).all()
    normal = want.float().abs() >= torch.finfo(fp8).smallest_normal
    assert differ[normal].float().mean() <= 0.10
