"""Every named tolerance of the suite, declared once (absolute, relative unless stated). Never
loosened to make a test pass: a failing comparison is a bug or a wrong expectation.
"""

# A backend against the float64 NumPy reference on the same (rounded) inputs, on o and on lse.
# float32 inputs: float32 accumulation over a few dozen keys lands near 1e-6. 16-bit inputs: o is
# rounded to the input dtype (bf16: 2^-8 relative, f16: 2^-11) and the kernels feed P to the PV
# dot in the input dtype, so about 1e-2 for bf16.
TOLERANCES = {
    "float32": dict(o=(2e-5, 2e-5), lse=(2e-5, 2e-5)),
    "bfloat16": dict(o=(2e-2, 2e-2), lse=(1e-2, 1e-2)),
    "float16": dict(o=(4e-3, 4e-3), lse=(2e-3, 2e-3)),
}

# Rolling vs the resident reference on identical inputs: only the merge order differs, so float32
# agrees to a few ulps of the accumulation (same scale as TOLERANCES["float32"]).
ROLLING_VS_RESIDENT = {"float32": (2e-6, 2e-6), "bfloat16": (2e-2, 2e-2), "float16": (4e-3, 4e-3)}

# The split-K decode kernel against the reference (o as assert_allclose keywords, lse atol = rtol).
# o from the dtype of the K/V operands fed to the dots: p is rounded to that dtype before the PV
# dot and o to q's dtype at the end, so ~4 ulp of the narrow type on values of order 1. LSE is
# computed in float32 from exact products (bf16*bf16 is exact in f32), so tight for every dtype.
DECODE_O_TOL = {
    "float32": dict(atol=2e-5, rtol=2e-5),
    "float16": dict(atol=2e-3, rtol=2e-3),   # 4 * 2**-11
    "bfloat16": dict(atol=1.6e-2, rtol=1.6e-2),  # 4 * 2**-8
}
DECODE_LSE_TOL = {"float32": 2e-5, "float16": 1e-4, "bfloat16": 1e-4}

# The host C kernel (float32 online softmax over any K/V dtype, inputs rounded as the kernel sees
# them) against the reference: atol = rtol.
CPU_KERNEL = {"float32": 1e-5, "bfloat16": 1e-5, "float16": 1e-5, "int8": 1e-5}

# One layer's rolling attention in the planner's long-context layout against the reference over
# all cells (tests/long_layer_vs_reference_test.py): atol = rtol; lse always at float32's. bf16
# K/V, float32 accumulation on both sides, the reference over all cells at once: the merge of
# partials reorders the sums (ROLLING_VS_RESIDENT's float32 is 2e-6 on the small cases).
LONG_LAYER = {"float32": 2e-5, "bfloat16": 2e-2}

# rkv's float32 logits against Hugging Face transformers' saved logits: max |delta|.
HF_LOGITS_ATOL = 1e-4
